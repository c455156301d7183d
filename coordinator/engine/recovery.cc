#include "coordinator/engine/recovery.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "coordinator/engine/text.h"
#include "shardcoord/proto/convert.h"

namespace shardcoord::coordinator {
namespace {

// Two held copies of one decision agree when everything but the delivery time does.
bool SameDecision(const v1::MicrobatchDecision& a, const v1::MicrobatchDecision& b) {
  v1::MicrobatchDecision x = a, y = b;
  x.clear_decided_unix_ms();
  y.clear_decided_unix_ms();
  return x.SerializeAsString() == y.SerializeAsString();
}

std::string Describe(const v1::MicrobatchDecision& d) {
  std::string out = absl::StrCat("seq ", d.seq(), " epoch ", d.epoch(), " [");
  for (int i = 0; i < d.modules_size(); ++i) {
    absl::StrAppend(&out, i ? ", " : "", d.modules(i).module(), "=", v1::Decision_Name(d.modules(i).decision()));
  }
  return out + "]";
}

absl::Status CheckEpochs(int group, const std::vector<MemberResume>& members, int64_t* epoch) {
  std::map<int64_t, std::vector<int>> by_epoch;
  for (const auto& m : members) by_epoch[m.state.group_epoch()].push_back(m.rank);
  *epoch = by_epoch.rbegin()->first;
  if (by_epoch.size() == 1) return absl::OkStatus();
  std::string parts;
  for (const auto& [e, ranks] : by_epoch) absl::StrAppend(&parts, parts.empty() ? "" : "; ", "ranks ", RankList(ranks), " at epoch ", e);
  return absl::FailedPreconditionError(absl::StrCat(
      "group ", group, " cannot resume after the coordinator restart: its members were in different epochs (", parts,
      "); the group re-forms"));
}

}  // namespace

GroupRecovery PlanGroupRecovery(int group, const std::vector<MemberResume>& members) {
  GroupRecovery out;
  if (members.empty()) return out;
  out.status = CheckEpochs(group, members, &out.epoch);
  if (!out.status.ok()) return out;
  for (const auto& m : members) {
    for (const auto& d : m.state.held()) {
      const MicrobatchKey key = KeyOf(d);
      auto [it, inserted] = out.binding.try_emplace(key, d);
      if (!inserted && !SameDecision(it->second, d)) {
        out.status = absl::FailedPreconditionError(absl::StrCat(
            "group ", group, ": contradictory decisions for microbatch ", key.ToString(), " after the coordinator "
            "restart: ", out.holders[key].size() == 1 ? "rank " : "ranks ",
            RankList(std::vector<int>(out.holders[key].begin(), out.holders[key].end())),
            out.holders[key].size() == 1 ? " holds " : " hold ", Describe(it->second), ", rank ", m.rank, " holds ", Describe(d),
            "; the group fails rather than run divergent collectives"));
        return out;
      }
      out.holders[key].insert(m.rank);
      out.next_seq = std::max(out.next_seq, d.seq() + 1);
    }
  }
  const bool any = !out.binding.empty();
  const MicrobatchKey newest = any ? out.binding.rbegin()->first : MicrobatchKey{};
  for (const auto& m : members) {
    for (const auto& p : m.state.undecided()) {
      const MicrobatchKey key = KeyOf(p);
      auto it = out.binding.find(key);
      if (it != out.binding.end()) {
        if (!out.holders[key].count(m.rank)) out.resend.emplace_back(m.rank, it->second);
      } else if (any && key < newest) {
        out.lost.emplace_back(m.rank, key);
      } else {
        out.undecided.emplace_back(m.rank, FromProto(p));
      }
    }
  }
  std::stable_sort(out.undecided.begin(), out.undecided.end(),
                   [](const auto& a, const auto& b) { return a.second.key < b.second.key; });
  if (any) {
    for (const auto& md : out.binding.rbegin()->second.modules()) {
      if (md.reason() == v1::REASON_PROMOTED) out.promoted.insert(md.module());
      if (md.reason() == v1::REASON_STICKY_REPLICATE ||
          (md.reason() == v1::REASON_DIVERGENT && md.decision() == v1::DECISION_REPLICATE)) {
        out.sticky.insert(md.module());  // Replicated from now on (fallback replicate).
      }
    }
  }
  return out;
}

}  // namespace shardcoord::coordinator
