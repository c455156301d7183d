// Unit tests of the registration checks (coordinator/registration.h): pure functions of the
// request, the limits and the group's first registration. CoreTest covers them through the
// core; these pin the messages and the order of the checks.
#include "coordinator/core/registration.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include <string>

#include "coordinator/server/wire_intake.h"

namespace {

using namespace shardcoord;
using shardcoord::coordinator::CheckSameAsReference;
using shardcoord::coordinator::CoordinatorLimits;
using shardcoord::coordinator::DescribeManifestDifference;
using shardcoord::coordinator::FromWire;
using shardcoord::coordinator::ValidateRegistration;
using ::testing::HasSubstr;

v1::RegisterRequest Request(int rank) {
  v1::RegisterRequest r;
  r.set_job_id("job");
  r.set_rank(rank);
  r.set_world_size(4);
  r.set_group_size(2);
  r.set_policy(v1::POLICY_AUTO);
  r.set_fallback(v1::FALLBACK_ROOT);
  r.set_wrap_outer_model(true);
  r.set_lookahead(4);
  auto* m = r.add_modules();
  m->set_name("visual");
  m->set_param_bytes(200);
  for (const char* unit : {"blocks.0", "blocks.1"}) {
    auto* u = m->add_units();
    u->set_name(unit);
    u->set_param_bytes(100);
  }
  return r;
}

TEST(RegistrationTest, AWellFormedRequestPasses) {
  EXPECT_TRUE(ValidateRegistration(FromWire(Request(1)), CoordinatorLimits{}, 64).ok());
}

TEST(RegistrationTest, ARestUnitBesideLayerUnitsPasses) {
  // A Hugging Face tower: the rest unit "" (embeddings, norms, merger) and its layers.
  v1::RegisterRequest r = Request(1);
  r.mutable_modules(0)->set_param_bytes(240);
  v1::LayerUnit rest;
  rest.set_name("");
  rest.set_param_bytes(40);
  auto* units = r.mutable_modules(0)->mutable_units();
  units->Add()->CopyFrom(rest);
  std::rotate(units->begin(), units->end() - 1, units->end());  // The rest unit first, as manifests list it.
  EXPECT_TRUE(ValidateRegistration(FromWire(r), CoordinatorLimits{}, 64).ok());
}

TEST(RegistrationTest, TheRestUnitAndUnitSizesAreCheckedAsDesignSays) {
  // The probe: a rest after or between layers, larger than its module, units summing past the
  // module, a 2^62-byte rest were all accepted.
  struct Case {
    void (*mutate)(v1::RegisterRequest&);
    std::string says;
  };
  const Case cases[] = {
      {[](auto& r) { r.mutable_modules(0)->mutable_units(1)->set_name(""); },
       "lists its rest unit \"\" at position 1: the rest unit comes first"},
      {[](auto& r) { r.mutable_modules(0)->mutable_units(0)->set_param_bytes(201); },
       "unit 'blocks.0' has 201 bytes, more than the module's param_bytes 200"},
      {[](auto& r) { r.mutable_modules(0)->mutable_units(1)->set_param_bytes(150); },
       "its units hold 250 bytes together, more than the module's param_bytes 200"},
      {[](auto& r) {
         r.mutable_modules(0)->set_param_bytes(int64_t{1} << 62);
         r.mutable_modules(0)->mutable_units(0)->set_name("");
         r.mutable_modules(0)->mutable_units(0)->set_param_bytes(int64_t{1} << 62);
       },
       "over 2^50"},
  };
  for (const Case& c : cases) {
    v1::RegisterRequest r = Request(1);
    c.mutate(r);
    absl::Status s = ValidateRegistration(FromWire(r), CoordinatorLimits{}, 64);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.says << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(c.says));
  }
}

TEST(RegistrationTest, EachBadFieldIsNamed) {
  struct Case {
    void (*mutate)(v1::RegisterRequest&);
    absl::StatusCode code;
    std::string says;
  };
  const Case cases[] = {
      {[](auto& r) { r.clear_job_id(); }, absl::StatusCode::kInvalidArgument, "job_id is empty"},
      {[](auto& r) { r.set_world_size(0); }, absl::StatusCode::kInvalidArgument, "world_size 0 must be >= 1"},
      {[](auto& r) { r.set_group_size(3); }, absl::StatusCode::kInvalidArgument, "group_size 3 must be >= 1 and divide"},
      {[](auto& r) { r.set_rank(4); }, absl::StatusCode::kInvalidArgument, "unknown rank 4: job 'job' has ranks 0..3"},
      {[](auto& r) { r.set_memory_budget_bytes(-5); }, absl::StatusCode::kInvalidArgument, "memory_budget_bytes -5"},
      {[](auto& r) { r.mutable_modules(0)->set_name(""); }, absl::StatusCode::kInvalidArgument, "empty name"},
      {[](auto& r) { *r.add_modules() = r.modules(0); }, absl::StatusCode::kInvalidArgument, "module 'visual' twice"},
      {[](auto& r) { r.mutable_modules(0)->mutable_units(1)->set_name("blocks.0"); },
       absl::StatusCode::kInvalidArgument, "layer unit 'blocks.0' twice"},
      {[](auto& r) {
         r.mutable_modules(0)->mutable_units(0)->set_name("");
         r.mutable_modules(0)->mutable_units(1)->set_name("");
       },
       absl::StatusCode::kInvalidArgument, "rest unit \"\" at position 1"},
      {[](auto& r) { r.mutable_modules(0)->set_param_bytes(-1); }, absl::StatusCode::kInvalidArgument,
       "negative param_bytes -1"},
      {[](auto& r) { r.set_policy(static_cast<v1::Policy>(99)); }, absl::StatusCode::kInvalidArgument,
       "unknown policy or fallback"},
      {[](auto& r) { r.set_lookahead(65); }, absl::StatusCode::kInvalidArgument, "lookahead 65 of rank 1 is outside 1..64"},
      {[](auto& r) { r.set_world_size(1 << 30); r.set_group_size(1); }, absl::StatusCode::kResourceExhausted,
       "max_world_size"},
  };
  for (const Case& c : cases) {
    v1::RegisterRequest r = Request(1);
    c.mutate(r);
    absl::Status s = ValidateRegistration(FromWire(r), CoordinatorLimits{}, 64);
    EXPECT_EQ(s.code(), c.code) << c.says << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(c.says));
  }
}

TEST(RegistrationTest, ControlCharactersInIdsAndNamesAreRefusedAndNeverEchoedRaw) {
  const CoordinatorLimits lim;
  auto refused = [&](const v1::RegisterRequest& r, const std::string& what) {
    absl::Status s = ValidateRegistration(FromWire(r), lim, 64);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(s.message(), HasSubstr(what));
    EXPECT_THAT(s.message(), HasSubstr("control character"));
    for (char c : s.message()) EXPECT_FALSE(c == '\n' || c == '\x1b') << "raw control character echoed: " << s;
  };
  v1::RegisterRequest r = Request(0);
  r.set_job_id("job\nevent=rank_dead job=other");  // Would forge a log line.
  refused(r, "job_id 'job\\x0aevent=rank_dead");
  r = Request(0);
  r.set_host("\x1b[2Jhost");  // Would clear an operator's terminal.
  refused(r, "host '\\x1b[2Jhost'");
  r = Request(0);
  r.mutable_modules(0)->set_name("vis\rual");
  refused(r, "a module name");
  r = Request(0);
  r.mutable_modules(0)->mutable_units(1)->set_name("blocks.1\x7f");
  refused(r, "a unit name");
  r = Request(0);
  r.set_job_id("tâche-é");  // UTF-8 is fine.
  EXPECT_TRUE(ValidateRegistration(FromWire(r), lim, 64).ok());
  // C1 controls (U+009B is a terminal's CSI) and bidi overrides (U+202E) reached the page and
  // shardctl raw: refused like C0 ones.
  r = Request(0);
  r.set_job_id("job\xc2\x9b" "2J");
  refused(r, "the control character U+009B");
  r = Request(0);
  r.set_host("host\xe2\x80\xaetxt.exe");
  refused(r, "the control character U+202E");
}

TEST(RegistrationTest, LimitsAreNamedWithTheirFlags) {
  CoordinatorLimits lim;
  lim.max_modules = 1;
  lim.max_units_per_module = 1;
  lim.max_name_bytes = 4;
  v1::RegisterRequest r = Request(0);
  *r.add_modules() = r.modules(0);
  r.mutable_modules(1)->set_name("audio");
  EXPECT_THAT(ValidateRegistration(FromWire(r), lim, 64).message(), HasSubstr("over the coordinator's max_modules (1)"));
  lim.max_modules = 8;
  EXPECT_THAT(ValidateRegistration(FromWire(Request(0)), lim, 64).message(), HasSubstr("raise --max-name-bytes"));
  lim.max_name_bytes = 64;
  EXPECT_THAT(ValidateRegistration(FromWire(Request(0)), lim, 64).message(), HasSubstr("raise --max-units-per-module"));
}

TEST(RegistrationTest, TheFirstDifferenceFromTheGroupsReferenceIsNamed) {
  const v1::RegisterRequest ref = Request(0);
  EXPECT_TRUE(CheckSameAsReference(FromWire(ref), 0, FromWire(Request(1)), " (job 'job', group 0)").ok());
  EXPECT_EQ(DescribeManifestDifference(FromWire(ref), 0, FromWire(Request(1)), 1), "");

  v1::RegisterRequest policy = Request(1);
  policy.set_policy(v1::POLICY_PER_LAYER);
  absl::Status s = CheckSameAsReference(FromWire(ref), 0, FromWire(policy), " (job 'job', group 0)");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("rank 1 registered policy per_layer but rank 0 registered auto (job 'job', "
                                     "group 0)"));

  v1::RegisterRequest unit = Request(1);
  unit.mutable_modules(0)->mutable_units(1)->set_param_bytes(101);
  s = CheckSameAsReference(FromWire(ref), 0, FromWire(unit), " (job 'job', group 0)");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("module 'visual': layer unit 1 is 'blocks.1' (101 bytes) on rank 1 vs "
                                     "'blocks.1' (100 bytes) on rank 0"));

  v1::RegisterRequest more = Request(1);
  more.add_modules()->set_name("audio");
  EXPECT_THAT(DescribeManifestDifference(FromWire(ref), 0, FromWire(more), 1),
              HasSubstr("rank 1 registered modules [visual, audio] but rank 0 registered [visual]"));
}

}  // namespace

namespace {

TEST(RegistrationTest, DefaultsComeFromTheCoordinatorAndRootNeedsAnOwner) {
  shardcoord::coordinator::CoordinatorOptions options;
  options.default_policy = Policy::kPerLayer;
  options.default_fallback = Fallback::kReplicate;
  options.max_lookahead = 2;
  v1::RegisterRequest bare = Request(0);
  bare.clear_policy();
  bare.clear_fallback();
  bare.clear_lookahead();
  const shardcoord::coordinator::Registration req =
      shardcoord::coordinator::WithRegisterDefaults(FromWire(bare), options);
  EXPECT_EQ(req.policy, Policy::kPerLayer);
  EXPECT_EQ(req.fallback, Fallback::kReplicate);
  EXPECT_EQ(req.lookahead, 2) << "the default lookahead, capped by max_lookahead";

  v1::RegisterRequest outside = Request(0);
  outside.set_wrap_outer_model(false);
  outside.mutable_modules(0)->set_outside_inner_root(true);
  absl::Status s = shardcoord::coordinator::CheckRootIsPossible(FromWire(outside));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("fallback root is impossible for rank 0"));
  EXPECT_THAT(s.message(), HasSubstr("[visual]"));
  outside.set_fallback(v1::FALLBACK_REPLICATE);
  EXPECT_TRUE(shardcoord::coordinator::CheckRootIsPossible(FromWire(outside)).ok()) << "no root involved";
  outside.mutable_modules(0)->set_trainable(true);  // Decided root where replicate would be.
  s = shardcoord::coordinator::CheckRootIsPossible(FromWire(outside));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("a trainable module is decided root"));
}

TEST(RegistrationTest, RanksMustAgreeWhetherAModuleTrains) {
  const shardcoord::coordinator::Registration a = FromWire(Request(0));
  v1::RegisterRequest trains = Request(1);
  trains.mutable_modules(0)->set_trainable(true);
  const std::string diff = shardcoord::coordinator::DescribeManifestDifference(a, 0, FromWire(trains), 1);
  EXPECT_THAT(diff, HasSubstr("module 'visual' is trainable on rank 1 but frozen on rank 0"));
}

}  // namespace
