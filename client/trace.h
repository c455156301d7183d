// Traces for `shardctl replay`: JSON lines, one per rank and microbatch,
//   {"rank":0,"step":0,"microbatch":0,"calls":{"vision_tower":1,"audio_tower":0}}
// and manifests: {"modules":[{"name":"vision_tower","param_bytes":1024,
//                              "units":[{"name":"layers.0","param_bytes":512}],
//                              "outside_inner_root":false}]}
#ifndef SHARDCOORD_CLIENT_TRACE_H_
#define SHARDCOORD_CLIENT_TRACE_H_

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

struct Trace {
  // rank -> key -> module -> calls. A (rank, key) absent here runs no controlled module.
  std::map<int, std::map<MicrobatchKey, std::map<std::string, int32_t>>> plans;
  std::set<MicrobatchKey> keys;        // Every microbatch any rank mentions, ascending.
  std::set<std::string> module_names;  // Every module any line names.
  int max_rank = -1;
};

// Parses a trace. Errors (INVALID_ARGUMENT) name the source, the line and the field.
absl::StatusOr<Trace> ParseTrace(std::istream& in, const std::string& source_name);

// Parses a manifest file's contents.
absl::StatusOr<std::vector<ModuleSpec>> ParseManifest(const std::string& json_text,
                                                      const std::string& source_name);

}  // namespace shardcoord::client

#endif  // SHARDCOORD_CLIENT_TRACE_H_
