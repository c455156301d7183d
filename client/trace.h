// Traces for `shardctl replay` and `plan`: JSON lines, one per rank and microbatch,
//   {"rank":0,"step":0,"microbatch":0,"calls":{"vision_tower":1,"audio_tower":0},"tokens":12288}
// "tokens" (optional): the decoder tokens of that rank's microbatch, text and media, which
// `shardctl plan` prices with a cost file's other_seconds_per_token (replay ignores it). Every line
// of a trace gives it, or none does.
// and manifests: {"modules":[{"name":"vision_tower","param_bytes":1024,
//                              "units":[{"name":"layers.0","param_bytes":512}],
//                              "outside_inner_root":false,"trainable":false}]}
// ("trainable", optional: the module trains, so it is decided skip, per_layer or root only).
#ifndef SHARDCOORD_CLIENT_TRACE_H_
#define SHARDCOORD_CLIENT_TRACE_H_

#include <cstdint>
#include <istream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "shardcoord/types.h"

namespace shardcoord::client {

// Largest world size a replay registers or a plan simulates (--world-size, or the trace's
// highest rank + 1).
inline constexpr int kMaxReplayWorldSize = 1 << 20;

// Most decoder tokens a trace line may give for one microbatch.
inline constexpr int64_t kMaxTraceTokens = INT32_MAX;

struct Trace {
  // rank -> key -> module -> calls. A (rank, key) absent here runs no controlled module.
  std::map<int, std::map<MicrobatchKey, std::map<std::string, int32_t>>> plans;
  // rank -> key -> the decoder tokens of that rank's microbatch: the same lines as `plans`, or
  // empty when the trace gives no tokens.
  std::map<int, std::map<MicrobatchKey, int64_t>> tokens;
  std::set<MicrobatchKey> keys;        // Every microbatch any rank mentions, ascending.
  std::set<std::string> module_names;  // Every module any line names.
  int max_rank = -1;

  bool has_tokens() const { return !tokens.empty(); }
};

// Parses a trace. Errors (INVALID_ARGUMENT) name the source, the line and the field.
absl::StatusOr<Trace> ParseTrace(std::istream& in, const std::string& source_name);

// Parses a manifest file's contents.
absl::StatusOr<std::vector<ModuleSpec>> ParseManifest(const std::string& json_text,
                                                      const std::string& source_name);

}  // namespace shardcoord::client

#endif  // SHARDCOORD_CLIENT_TRACE_H_
