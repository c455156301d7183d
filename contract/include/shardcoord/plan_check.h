// What makes a plan well formed (DESIGN 3, "Bad input"), checked the same way by the worker
// (before it sends) and by the coordinator (when it receives). Each function returns "" when
// the part is well formed, else what is wrong; callers say which plan and rank it is and
// answer INVALID_ARGUMENT.
#ifndef SHARDCOORD_PLAN_CHECK_H_
#define SHARDCOORD_PLAN_CHECK_H_

#include <cstdint>
#include <string>
#include <vector>

#include "shardcoord/export.h"
#include "shardcoord/types.h"

namespace shardcoord {

// Error messages and log lines name at most this many modules (a manifest may hold a thousand).
inline constexpr size_t kNamesInMessages = 16;

// "a, b, c", or the first kNamesInMessages and "... (N more)"; each name as Printable.
SHARDCOORD_EXPORT std::string NamesForMessage(const std::vector<std::string>& names);

// Ids and names may not hold control characters (a newline would forge log and CLI lines, an
// escape sequence would reach operators' terminals). "" when `name` has none, else which
// byte is one.
SHARDCOORD_EXPORT std::string ControlCharacterIn(const std::string& name);
// `text` safe to print: control characters as \xNN, cut after `max_bytes` ("...").
SHARDCOORD_EXPORT std::string Printable(const std::string& text, size_t max_bytes = 256);

// Keys are (step, microbatch), both >= 0.
SHARDCOORD_EXPORT std::string CheckPlanKey(const MicrobatchKey& key);

// Most calls of one module a rank may plan in one microbatch. A padded decision makes every rank
// of the group as many passes as the busiest plans, so one rank's wrong count (image tokens
// reported as calls) must not make the others gather for hours: refused here, on both sides.
inline constexpr int64_t kMaxCallsPerModule = 4096;

// Whether a module decision `d` may carry `calls` passes: a padded decision 1 to
// kMaxCallsPerModule (a plan of the busiest rank), every other decision none.
inline bool PassesFit(Decision d, int64_t calls) {
  return d == Decision::kPadded ? calls >= 1 && calls <= kMaxCallsPerModule : calls == 0;
}

// One entry of a plan: `module` must be registered (`known`; `registered` lists them for the
// message, at most kNamesInMessages named) and 0 <= `calls` <= kMaxCallsPerModule.
SHARDCOORD_EXPORT std::string CheckPlanCall(const std::string& module, int64_t calls, bool known,
                                            const std::vector<std::string>& registered);

}  // namespace shardcoord

#endif  // SHARDCOORD_PLAN_CHECK_H_
