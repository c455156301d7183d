// Unit tests of coordinator options: the YAML config file (LoadConfigFile), the range
// and relation checks (ValidateOptions) and what serving needs (CheckServingNeeds).
#include "coordinator/daemon/serving_check.h"
#include "coordinator/settings/options.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "support/certs.h"
#include "support/subprocess.h"
#include "support/test_env.h"

namespace {

using namespace shardcoord;
using shardcoord::coordinator::CoordinatorOptions;
using shardcoord::coordinator::LoadConfigFile;
using shardcoord::coordinator::ValidateOptions;
using ::testing::HasSubstr;

std::string WriteConfig(const shardcoord::testing::TempDir& dir, const std::string& text,
                        const std::string& name = "shardcoordd.yaml") {
  const std::string path = dir.File(name);
  std::ofstream out(path);
  out << text;
  out.close();
  EXPECT_TRUE(out.good()) << "cannot write " << path;
  return path;
}

// ---------------------------------------------------------------------------------------
// LoadConfigFile

TEST(LoadConfigFileTest, SetsEveryKey) {
  shardcoord::testing::TempDir dir;
  const std::string path = WriteConfig(dir, R"(
listen: "0.0.0.0:9000"
default_policy: per_layer
default_fallback: replicate
heartbeat_interval_ms: 250
heartbeat_timeout_ms: 3000
plan_timeout_ms: 45000
max_lookahead: 16
promote_window: 20
promote_threshold: 5
demote_threshold: 1
event_capacity: 500
decision_history: 64
log_level: debug
address_file: /tmp/shardcoordd.addr
token_file: /etc/shardcoord/tokens
recovery_window_ms: 20000
state_file: /var/lib/shardcoord/state
max_communicators_per_job: 8
max_store_value_bytes: 4096
insecure: false
tls_cert_file: /etc/shardcoord/tls.crt
tls_key_file: /etc/shardcoord/tls.key
tls_client_ca_file: /etc/shardcoord/clients.pem
tls_reload_interval_s: 30
)");
  absl::StatusOr<CoordinatorOptions> o = LoadConfigFile(path);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->listen_address, "0.0.0.0:9000");
  EXPECT_EQ(o->default_policy, Policy::kPerLayer);
  EXPECT_EQ(o->default_fallback, Fallback::kReplicate);
  EXPECT_EQ(o->heartbeat_interval, absl::Milliseconds(250));
  EXPECT_EQ(o->heartbeat_timeout, absl::Milliseconds(3000));
  EXPECT_EQ(o->plan_timeout, absl::Milliseconds(45000));
  EXPECT_EQ(o->max_lookahead, 16);
  EXPECT_EQ(o->promotion.window, 20);
  EXPECT_EQ(o->promotion.promote_threshold, 5);
  EXPECT_EQ(o->promotion.demote_threshold, 1);
  EXPECT_EQ(o->event_capacity, 500);
  EXPECT_EQ(o->decision_history, 64);
  EXPECT_EQ(o->log_level, "debug");
  EXPECT_EQ(o->address_file, "/tmp/shardcoordd.addr");
  EXPECT_EQ(o->token_file, "/etc/shardcoord/tokens");
  EXPECT_EQ(o->recovery_window, absl::Milliseconds(20000));
  EXPECT_EQ(o->state_file, "/var/lib/shardcoord/state");
  EXPECT_EQ(o->limits.max_communicators_per_job, 8);
  EXPECT_EQ(o->limits.max_store_value_bytes, 4096);
  EXPECT_FALSE(o->insecure);
  EXPECT_EQ(o->tls.cert_file, "/etc/shardcoord/tls.crt");
  EXPECT_EQ(o->tls.key_file, "/etc/shardcoord/tls.key");
  EXPECT_EQ(o->tls.client_ca_file, "/etc/shardcoord/clients.pem");
  EXPECT_EQ(o->tls.reload_interval, absl::Seconds(30));
  EXPECT_TRUE(ValidateOptions(*o).ok()) << ValidateOptions(*o);
}

TEST(LoadConfigFileTest, KeysNotInFileKeepTheBaseValues) {
  shardcoord::testing::TempDir dir;
  const std::string path = WriteConfig(dir, "max_lookahead: 8\n");
  CoordinatorOptions base;
  base.listen_address = "127.0.0.1:0";
  base.default_policy = Policy::kRoot;
  absl::StatusOr<CoordinatorOptions> o = LoadConfigFile(path, base);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->max_lookahead, 8);
  EXPECT_EQ(o->listen_address, "127.0.0.1:0");
  EXPECT_EQ(o->default_policy, Policy::kRoot);
  EXPECT_EQ(o->heartbeat_interval, coordinator::kDefaultHeartbeatInterval);
}

TEST(LoadConfigFileTest, UnknownKeyIsInvalidArgumentNamingTheKey) {
  shardcoord::testing::TempDir dir;
  const std::string path = WriteConfig(dir, "listen: 127.0.0.1:1\nheartbeat_intervl_ms: 100\n");
  absl::StatusOr<CoordinatorOptions> o = LoadConfigFile(path);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(o.status().message(), HasSubstr("heartbeat_intervl_ms"));
  EXPECT_THAT(o.status().message(), HasSubstr(path));
  // The accepted keys are listed so the typo can be fixed.
  EXPECT_THAT(o.status().message(), HasSubstr("heartbeat_interval_ms"));
}

TEST(LoadConfigFileTest, BadPolicyValueNamesTheValue) {
  shardcoord::testing::TempDir dir;
  const std::string path = WriteConfig(dir, "default_policy: sometimes\n");
  absl::StatusOr<CoordinatorOptions> o = LoadConfigFile(path);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(o.status().message(), HasSubstr("default_policy"));
  EXPECT_THAT(o.status().message(), HasSubstr("sometimes"));
}

TEST(LoadConfigFileTest, BadFallbackValueNamesTheValue) {
  shardcoord::testing::TempDir dir;
  // "auto" is a policy, not a fallback.
  const std::string path = WriteConfig(dir, "default_fallback: auto\n");
  absl::StatusOr<CoordinatorOptions> o = LoadConfigFile(path);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(o.status().message(), HasSubstr("default_fallback"));
  EXPECT_THAT(o.status().message(), HasSubstr("'auto'"));
}

TEST(LoadConfigFileTest, WrongTypeNamesTheKey) {
  shardcoord::testing::TempDir dir;
  const std::string path = WriteConfig(dir, "heartbeat_interval_ms: \"abc\"\n");
  absl::StatusOr<CoordinatorOptions> o = LoadConfigFile(path);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(o.status().message(), HasSubstr("heartbeat_interval_ms"));
  EXPECT_THAT(o.status().message(), HasSubstr("wrong type"));
}

TEST(LoadConfigFileTest, ListValueForIntegerKeyIsWrongType) {
  shardcoord::testing::TempDir dir;
  const std::string path = WriteConfig(dir, "max_lookahead: [1, 2]\n");
  absl::StatusOr<CoordinatorOptions> o = LoadConfigFile(path);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(o.status().message(), HasSubstr("max_lookahead"));
}

TEST(LoadConfigFileTest, MissingFileIsNotFound) {
  shardcoord::testing::TempDir dir;
  const std::string path = dir.File("does_not_exist.yaml");
  absl::StatusOr<CoordinatorOptions> o = LoadConfigFile(path);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(o.status().message(), HasSubstr(path));
}

TEST(LoadConfigFileTest, EmptyFileGivesDefaults) {
  shardcoord::testing::TempDir dir;
  const std::string path = WriteConfig(dir, "");
  absl::StatusOr<CoordinatorOptions> o = LoadConfigFile(path);
  ASSERT_TRUE(o.ok()) << o.status();
  const CoordinatorOptions d;
  EXPECT_EQ(o->listen_address, coordinator::kDefaultListenAddress);
  EXPECT_EQ(o->default_policy, Policy::kAuto);
  EXPECT_EQ(o->default_fallback, Fallback::kRoot);
  EXPECT_EQ(o->heartbeat_interval, coordinator::kDefaultHeartbeatInterval);
  EXPECT_EQ(o->heartbeat_timeout, coordinator::kDefaultHeartbeatTimeout);
  EXPECT_EQ(o->plan_timeout, coordinator::kDefaultPlanTimeout);
  EXPECT_EQ(o->max_lookahead, coordinator::kDefaultMaxLookahead);
  EXPECT_EQ(o->promotion.window, coordinator::kDefaultPromoteWindow);
  EXPECT_EQ(o->promotion.promote_threshold, coordinator::kDefaultPromoteThreshold);
  EXPECT_EQ(o->promotion.demote_threshold, coordinator::kDefaultDemoteThreshold);
  EXPECT_EQ(o->event_capacity, coordinator::kDefaultEventCapacity);
  EXPECT_EQ(o->decision_history, coordinator::kDefaultDecisionHistory);
  EXPECT_EQ(o->log_level, d.log_level);
  EXPECT_EQ(o->address_file, "");
}

TEST(LoadConfigFileTest, CommentOnlyFileGivesDefaults) {
  shardcoord::testing::TempDir dir;
  const std::string path = WriteConfig(dir, "# nothing configured yet\n");
  absl::StatusOr<CoordinatorOptions> o = LoadConfigFile(path);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->max_lookahead, coordinator::kDefaultMaxLookahead);
}

TEST(LoadConfigFileTest, NonMappingIsInvalidArgument) {
  shardcoord::testing::TempDir dir;
  const std::string path = WriteConfig(dir, "- listen\n- default_policy\n");
  absl::StatusOr<CoordinatorOptions> o = LoadConfigFile(path);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(o.status().message(), HasSubstr("mapping"));
}

// A valid YAML file whose key is not a scalar must be an error, not an abort; the child
// process keeps an abort from taking the whole suite down.
TEST(LoadConfigFileDeathTest, NonScalarKeyIsInvalidArgumentNotACrash) {
  shardcoord::testing::TempDir dir;
  const std::string path = WriteConfig(dir, "[a, b]: 1\n");
  EXPECT_EXIT(
      {
        absl::StatusOr<CoordinatorOptions> o = LoadConfigFile(path);
        const bool good = !o.ok() && o.status().code() == absl::StatusCode::kInvalidArgument;
        std::exit(good ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(LoadConfigFileTest, MalformedYamlIsInvalidArgument) {
  shardcoord::testing::TempDir dir;
  const std::string path = WriteConfig(dir, "listen: [unclosed\n");
  absl::StatusOr<CoordinatorOptions> o = LoadConfigFile(path);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(o.status().message(), HasSubstr("not valid YAML"));
}

// ---------------------------------------------------------------------------------------
// ValidateOptions

TEST(ValidateOptionsTest, AcceptsDefaults) {
  absl::Status s = ValidateOptions(CoordinatorOptions{});
  EXPECT_TRUE(s.ok()) << s;
}

TEST(ValidateOptionsTest, RejectsTimeoutBelowTwiceIntervalNamingBothNumbers) {
  CoordinatorOptions o;
  o.heartbeat_interval = absl::Milliseconds(700);
  o.heartbeat_timeout = absl::Milliseconds(1399);
  absl::Status s = ValidateOptions(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("1399"));
  EXPECT_THAT(s.message(), HasSubstr("700"));
  EXPECT_THAT(s.message(), HasSubstr("heartbeat timeout"));

  o.heartbeat_timeout = absl::Milliseconds(1400);  // Exactly twice: accepted.
  EXPECT_TRUE(ValidateOptions(o).ok()) << ValidateOptions(o);
}

TEST(ValidateOptionsTest, HeartbeatsFasterThanTheDaemonCanTellAreRefused) {
  // 10 ms timeouts were accepted: silent ranks were then never declared dead, and ~190 pause
  // events a second flooded the log.
  CoordinatorOptions o;
  o.heartbeat_interval = absl::Milliseconds(5);
  o.heartbeat_timeout = absl::Milliseconds(200);
  EXPECT_THAT(ValidateOptions(o).message(), HasSubstr("heartbeat interval (5 ms) must be at least 10 ms"));
  o.heartbeat_interval = absl::Milliseconds(10);
  o.heartbeat_timeout = absl::Milliseconds(20);
  EXPECT_THAT(ValidateOptions(o).message(), HasSubstr("heartbeat timeout (20 ms) must be at least 100 ms"));
  o.heartbeat_timeout = absl::Milliseconds(100);
  EXPECT_TRUE(ValidateOptions(o).ok()) << ValidateOptions(o);
}

TEST(ValidateOptionsTest, SessionThreadsOutsideTheirRangeAreRefusedNamingTheRange) {
  CoordinatorOptions o;
  o.session_threads = -1;
  EXPECT_EQ(ValidateOptions(o).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ValidateOptions(o).message(),
              HasSubstr("session threads (-1) must be at least 0 (config key session_threads, flag "
                        "--session-threads)"));
  o.session_threads = 1025;
  EXPECT_EQ(ValidateOptions(o).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ValidateOptions(o).message(), HasSubstr("session threads (1025) must be at most 1024"));
  for (int good : {0, 1, 64}) {
    o.session_threads = good;
    EXPECT_TRUE(ValidateOptions(o).ok());
  }
}

TEST(ValidateOptionsTest, RejectsZeroMaxLookahead) {
  CoordinatorOptions o;
  o.max_lookahead = 0;
  absl::Status s = ValidateOptions(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("lookahead"));
  o.max_lookahead = 1;
  EXPECT_TRUE(ValidateOptions(o).ok());
}

TEST(ValidateOptionsTest, RejectsPromoteThresholdAboveWindow) {
  CoordinatorOptions o;
  o.promotion.window = 4;
  o.promotion.promote_threshold = 5;
  o.promotion.demote_threshold = 0;
  absl::Status s = ValidateOptions(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("promote_threshold"));
  EXPECT_THAT(s.message(), HasSubstr("promote_window"));
  o.promotion.promote_threshold = 4;  // Equal to the window: accepted.
  EXPECT_TRUE(ValidateOptions(o).ok()) << ValidateOptions(o);
}

TEST(ValidateOptionsTest, RejectsDemoteThresholdNotBelowPromote) {
  CoordinatorOptions o;
  o.promotion.window = 8;
  o.promotion.promote_threshold = 3;
  o.promotion.demote_threshold = 3;
  absl::Status s = ValidateOptions(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("demote_threshold"));
  o.promotion.demote_threshold = 2;
  EXPECT_TRUE(ValidateOptions(o).ok()) << ValidateOptions(o);
}

TEST(ValidateOptionsTest, RejectsOtherOutOfRangeFields) {
  {
    CoordinatorOptions o;
    o.listen_address = "";
    EXPECT_EQ(ValidateOptions(o).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(ValidateOptions(o).message(), HasSubstr("listen"));
  }
  {
    CoordinatorOptions o;
    o.heartbeat_interval = absl::ZeroDuration();
    EXPECT_EQ(ValidateOptions(o).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(ValidateOptions(o).message(), HasSubstr("heartbeat interval"));
  }
  {
    CoordinatorOptions o;
    o.plan_timeout = absl::ZeroDuration();
    EXPECT_EQ(ValidateOptions(o).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(ValidateOptions(o).message(), HasSubstr("plan timeout"));
  }
  {
    CoordinatorOptions o;
    o.event_capacity = 0;
    EXPECT_EQ(ValidateOptions(o).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(ValidateOptions(o).message(), HasSubstr("event_capacity"));
  }
  {
    CoordinatorOptions o;
    o.default_policy = Policy::kUnspecified;
    EXPECT_EQ(ValidateOptions(o).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(ValidateOptions(o).message(), HasSubstr("policy"));
  }
}

}  // namespace

TEST(ValidateOptionsTest, RejectsDurationsThatDoNotFitTheWireNamingThem) {
  CoordinatorOptions o;
  o.heartbeat_interval = absl::Milliseconds(3000000000LL);  // Told to workers as int32 ms.
  o.heartbeat_timeout = 2 * o.heartbeat_interval;
  absl::Status s = ValidateOptions(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("heartbeat interval (3000000000 ms) must be at most 24 h"));
}

TEST(ValidateOptionsTest, RejectsLimitsBelowOneNamingThem) {
  for (auto set : std::vector<std::function<void(CoordinatorOptions&)>>{
           [](CoordinatorOptions& o) { o.limits.max_world_size = 0; },
           [](CoordinatorOptions& o) { o.limits.max_jobs = -1; },
           [](CoordinatorOptions& o) { o.limits.max_outbox_bytes = 1000; },
           [](CoordinatorOptions& o) { o.limits.max_buffered_bytes = 1000; },
           [](CoordinatorOptions& o) { o.limits.handshake_timeout = absl::ZeroDuration(); }}) {
    CoordinatorOptions o;
    set(o);
    EXPECT_EQ(ValidateOptions(o).code(), absl::StatusCode::kInvalidArgument) << ValidateOptions(o);
  }
}

TEST(LoadConfigFileTest, DuplicateKeysPaddedNumbersAndImpossibleBoundsAreRefused) {
  // The probes: a key given twice, " 5" for a number and max_world_size above max_total_ranks were
  // accepted silently.
  shardcoord::testing::TempDir dir;
  auto twice = LoadConfigFile(WriteConfig(dir, "max_jobs: 3\nmax_jobs: 5\n"));
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(twice.status().message()), HasSubstr("key 'max_jobs' is given twice"));
  auto padded = LoadConfigFile(WriteConfig(dir, "max_jobs: \" 5\"\n"));
  EXPECT_EQ(padded.status().code(), absl::StatusCode::kInvalidArgument) << padded.status();
  EXPECT_THAT(std::string(padded.status().message()), HasSubstr("max_jobs"));
  CoordinatorOptions o;
  o.limits.max_world_size = 1024;
  o.limits.max_total_ranks = 512;
  EXPECT_THAT(std::string(ValidateOptions(o).message()),
              HasSubstr("max_world_size (1024) is above max_total_ranks (512): a job of that size could never be "
                        "admitted"));
}

TEST(LoadConfigFileTest, ReadsTheLimits) {
  shardcoord::testing::TempDir dir;
  auto o = LoadConfigFile(WriteConfig(dir, "max_world_size: 128\nmax_total_ranks: 512\nmax_jobs: 3\n"
                                           "max_outbox_bytes: 1048576\njob_retention_ms: 5000\n"
                                           "self_check_interval_ms: 0\nmax_buffered_bytes: 2097152\n"));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->limits.max_world_size, 128);
  EXPECT_EQ(o->limits.max_total_ranks, 512);
  EXPECT_EQ(o->limits.max_jobs, 3);
  EXPECT_EQ(o->limits.max_outbox_bytes, 1048576);
  EXPECT_EQ(o->limits.max_buffered_bytes, 2097152);
  EXPECT_EQ(o->limits.job_retention, absl::Seconds(5));
  EXPECT_EQ(o->limits.self_check_interval, absl::ZeroDuration());
  EXPECT_TRUE(ValidateOptions(*o).ok());
}

// ---------------------------------------------------------------------------------------
// Settings(): the one table the config file's keys, the daemon's flags and the range checks
// are made from.

namespace {

using shardcoord::coordinator::EnvName;
using shardcoord::coordinator::FindSetting;
using shardcoord::coordinator::FlagName;
using shardcoord::coordinator::Setting;
using shardcoord::coordinator::SetFromText;
using shardcoord::coordinator::Settings;
using shardcoord::coordinator::SettingValueText;
using shardcoord::coordinator::ValueTypeName;

bool IsNumber(const Setting& s) {
  const std::string type = ValueTypeName(s);
  return type == "INT" || type == "MS" || type == "S" || type == "HOURS";
}

TEST(SettingsTableTest, EveryKeyIsAlsoItsFlagWithDashes) {
  std::set<std::string> flags;
  for (const Setting& s : Settings()) {
    SCOPED_TRACE(s.key);
    const std::string key = s.key;
    EXPECT_EQ(key.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_"), std::string::npos);
    std::string dashed = key;
    std::replace(dashed.begin(), dashed.end(), '_', '-');
    EXPECT_EQ(FlagName(key), "--" + dashed);
    EXPECT_TRUE(flags.insert(FlagName(key)).second) << "two settings with one flag";
    if (s.renamed_from != nullptr) {
      EXPECT_TRUE(flags.insert(FlagName(s.renamed_from)).second);
    }
    EXPECT_NE(std::string(s.help), "");
    EXPECT_EQ(FindSetting(key), &s);
  }
  EXPECT_EQ(FindSetting("no_such_key"), nullptr);
  EXPECT_EQ(FlagName("tls_cert_file"), "--tls-cert-file");
  EXPECT_EQ(EnvName("tls_cert_file"), "SHARDCOORD_DAEMON_TLS_CERT_FILE");
}

// settings.def is the one definition: every entry, of whichever struct, is a row of the table
// in the same order, and the row sets the field the entry declares (options.cc's macros put
// limits., promotion. and tls. before the right entries).
TEST(SettingsTableTest, EveryEntryOfSettingsDefIsTheRowThatSetsItsField) {
  CoordinatorOptions o;
  struct Entry {
    std::string key;
    const void* field;
  };
  const std::vector<Entry> entries = {
#define DAEMON_SETTING(Type, Field, Default, Key, Help, Rules) {Key, &o.Field},
#define LIMIT_SETTING(Type, Field, Default, Key, Help, Rules) {Key, &o.limits.Field},
#define PROMOTION_SETTING(Type, Field, Default, Key, Help, Rules) {Key, &o.promotion.Field},
#define TLS_SETTING(Type, Field, Default, Key, Help, Rules) {Key, &o.tls.Field},
#include "coordinator/settings/settings.def"
  };
  ASSERT_EQ(entries.size(), Settings().size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const Setting& s = Settings()[i];
    SCOPED_TRACE(entries[i].key);
    EXPECT_EQ(s.key, entries[i].key);
    EXPECT_EQ(std::visit([&](auto field) -> const void* { return &field(o); }, s.field), entries[i].field);
  }
}

// The built-in defaults, as the shipped config file states them: it sets every key to its
// default but for the ones its header names (where to serve, the secrets, the state kept),
// so a default changed in settings.def and not there (or the reverse) fails here.
TEST(SettingsTableTest, TheShippedConfigStatesEveryBuiltInDefault) {
  const std::string path = SHARDCOORD_SOURCE_DIR "/deploy/config/shardcoordd.yaml";
  absl::StatusOr<CoordinatorOptions> shipped = LoadConfigFile(path);
  ASSERT_TRUE(shipped.ok()) << shipped.status();
  const std::set<std::string> deployment = {"listen",       "http_listen",  "token_file", "tls_cert_file",
                                            "tls_key_file", "journal_file", "state_file"};
  const CoordinatorOptions builtin;
  for (const Setting& s : Settings()) {
    const std::string value = SettingValueText(s, *shipped);
    if (deployment.count(s.key)) {
      EXPECT_NE(value, SettingValueText(s, builtin)) << s.key << ": the header says the file sets it";
    } else {
      EXPECT_EQ(value, SettingValueText(s, builtin)) << s.key;
    }
  }
}

// A key ends with its unit exactly when it is a duration; every number has a lower bound.
TEST(SettingsTableTest, DurationsNameTheirUnitAndNumbersHaveARange) {
  for (const Setting& s : Settings()) {
    SCOPED_TRACE(s.key);
    const bool unit_in_key =
        absl::EndsWith(s.key, "_ms") || absl::EndsWith(s.key, "_s") || absl::EndsWith(s.key, "_hours");
    EXPECT_EQ(std::holds_alternative<coordinator::SettingField<absl::Duration>>(s.field), unit_in_key);
    if (IsNumber(s)) {
      EXPECT_GT(s.min, std::numeric_limits<int64_t>::min());
      EXPECT_LE(s.min, s.max);
    } else {
      EXPECT_EQ(s.max, coordinator::kUnbounded) << "a range on a setting that is not a number";
    }
  }
}

// A value for the setting other than the built-in one (not necessarily within range).
std::string OtherValue(const Setting& s, const std::string& builtin) {
  if (ValueTypeName(s) == "BOOL") return builtin == "true" ? "false" : "true";
  const std::vector<std::string> choices = coordinator::SettingChoices(s);
  if (!choices.empty()) return choices.back() == builtin ? choices.front() : choices.back();
  if (!IsNumber(s)) return builtin + "-changed";
  int64_t n = 0;
  EXPECT_TRUE(absl::SimpleAtoi(builtin, &n)) << builtin;
  return absl::StrCat(n + 1);
}

// Each key, given alone, changes its own setting and no other (the table's fields are not
// mixed up), and reads back as written.
TEST(SettingsTableTest, EachKeyChangesItsOwnSettingOnly) {
  shardcoord::testing::TempDir dir;
  const CoordinatorOptions builtin;
  for (const Setting& s : Settings()) {
    SCOPED_TRACE(s.key);
    const std::string value = OtherValue(s, SettingValueText(s, builtin));
    absl::StatusOr<CoordinatorOptions> o =
        LoadConfigFile(WriteConfig(dir, absl::StrCat(s.key, ": \"", value, "\"\n")));
    ASSERT_TRUE(o.ok()) << o.status();
    for (const Setting& other : Settings()) {
      EXPECT_EQ(SettingValueText(other, *o), &other == &s ? value : SettingValueText(other, builtin))
          << other.key;
    }
  }
}

// Just past either end of each range: refused, naming the key and the flag.
TEST(SettingsTableTest, AValueOutOfRangeNamesTheKeyAndTheFlag) {
  int checked = 0;
  for (const Setting& s : Settings()) {
    if (!IsNumber(s)) continue;
    for (int64_t bad : {s.min - 1, s.max == coordinator::kUnbounded ? s.min - 1 : s.max + 1}) {
      SCOPED_TRACE(absl::StrCat(s.key, " ", bad));
      CoordinatorOptions o;
      ASSERT_TRUE(SetFromText(s, absl::StrCat(bad), o).ok());
      const absl::Status st = ValidateOptions(o);
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(st.message(), HasSubstr(absl::StrCat("config key ", s.key, ", flag ", FlagName(s.key))));
      ++checked;
    }
  }
  EXPECT_GT(checked, 40);
  CoordinatorOptions o;
  o.log_level = "verbose";
  EXPECT_THAT(ValidateOptions(o).message(),
              HasSubstr("log level 'verbose' is not one of trace, debug, info, warn, error, off (config key "
                        "log_level, flag --log-level)"));
  o = CoordinatorOptions{};
  o.listen_address = "7871";
  EXPECT_THAT(ValidateOptions(o).message(), HasSubstr("(config key listen, flag --listen, environment "
                                                      "SHARDCOORD_DAEMON_LISTEN)"));
}

TEST(SettingsTableTest, AValueOfTheWrongTypeSaysWhatIsExpected) {
  CoordinatorOptions o;
  EXPECT_THAT(SetFromText(*FindSetting("heartbeat_interval_ms"), "1.5", o).message(),
              HasSubstr("'1.5' is of the wrong type (a whole number of ms expected)"));
  EXPECT_THAT(SetFromText(*FindSetting("max_jobs"), "3000000000", o).message(), HasSubstr("out of range"));
  EXPECT_THAT(SetFromText(*FindSetting("insecure"), "maybe", o).message(), HasSubstr("true or false expected"));
  EXPECT_THAT(SetFromText(*FindSetting("default_fallback"), "auto", o).message(),
              HasSubstr("'auto' is not one of root, replicate"));
  ASSERT_TRUE(SetFromText(*FindSetting("tls_reload_interval_s"), "30", o).ok());
  EXPECT_EQ(o.tls.reload_interval, absl::Seconds(30));
  ASSERT_TRUE(SetFromText(*FindSetting("journal_retention_hours"), "2", o).ok());
  EXPECT_EQ(o.journal_retention, absl::Hours(2));
}

TEST(LoadConfigFileTest, UnknownKeyListsEveryAcceptedKeySorted) {
  shardcoord::testing::TempDir dir;
  const std::string path = WriteConfig(dir, "no_such_key: 1\n");
  absl::StatusOr<CoordinatorOptions> o = LoadConfigFile(path);
  ASSERT_FALSE(o.ok());
  std::vector<std::string> keys;
  for (const Setting& s : Settings()) keys.emplace_back(s.key);
  std::sort(keys.begin(), keys.end());
  EXPECT_THAT(o.status().message(), HasSubstr(absl::StrCat("config file ", path, ": unknown key 'no_such_key'; "
                                                           "accepted keys: ", absl::StrJoin(keys, ", "))));
}

TEST(LoadConfigFileTest, AnEmptyValueIsEmptyTextAndNothingElse) {
  shardcoord::testing::TempDir dir;
  CoordinatorOptions base;
  base.token_file = "/etc/tokens";
  absl::StatusOr<CoordinatorOptions> o = LoadConfigFile(WriteConfig(dir, "token_file:\n"), base);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->token_file, "");
  o = LoadConfigFile(WriteConfig(dir, "max_jobs:\n"));
  ASSERT_FALSE(o.ok());
  EXPECT_THAT(o.status().message(), HasSubstr("max_jobs has an empty value, a value of the wrong type"));
}

TEST(SettingsTableTest, ReadmeDocumentsEveryKey) {
  const std::string readme = shardcoord::testing::ReadFile(SHARDCOORD_SOURCE_DIR "/README.md");
  const size_t start = readme.find("## shardcoordd configuration");
  ASSERT_NE(start, std::string::npos);
  const std::string section = readme.substr(start, readme.find("\n## ", start + 1) - start);
  for (const Setting& s : Settings()) EXPECT_THAT(section, HasSubstr(absl::StrCat("`", s.key, "`")));
}

// ---------------------------------------------------------------------------------------
// shardcoordd's flags, made from the same table: the daemon itself, with --help or
// --check-config (which binds nothing but a free loopback port).

shardcoord::testing::RunResult Shardcoordd(std::vector<std::string> args, std::vector<std::string> env = {}) {
  args.insert(args.begin(), SHARDCOORDD_PATH);
  return shardcoord::testing::RunCommand(args, absl::Seconds(30), env);
}

int CountLines(const std::string& text, const std::string& part) {
  int n = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) n += absl::StrContains(line, part);
  return n;
}

TEST(DaemonFlagsTest, HelpListsTheFlagOfEveryKeyAndHidesRenamedOnes) {
  const shardcoord::testing::RunResult r = Shardcoordd({"--help"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const Setting& s : Settings()) {
    EXPECT_THAT(r.out, HasSubstr(FlagName(s.key) + " ")) << s.key;
    if (s.renamed_from != nullptr) {
      EXPECT_THAT(r.out, ::testing::Not(HasSubstr(FlagName(s.renamed_from) + " ")));
    }
  }
  EXPECT_THAT(r.out, HasSubstr("[env SHARDCOORD_DAEMON_TLS_CERT_FILE]"));
}

TEST(DaemonFlagsTest, ARenamedFlagStillWorksWithOneDeprecationLine) {
  shardcoord::testing::TempDir dir;
  const std::string cert = dir.File("no-cert.pem"), key = dir.File("no-key.pem");
  shardcoord::testing::RunResult r =
      Shardcoordd({"--listen", "127.0.0.1:0", "--tls-cert", cert, "--tls-key", key, "--check-config"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr(cert));  // Read as --tls-cert-file: the check looked for it.
  EXPECT_EQ(CountLines(r.err, "--tls-cert is deprecated: rename it --tls-cert-file"), 1) << r.err;
  EXPECT_EQ(CountLines(r.err, "--tls-key is deprecated: rename it --tls-key-file"), 1) << r.err;
  // Both names: the new one wins.
  r = Shardcoordd({"--listen", "127.0.0.1:0", "--tls-cert-file", cert, "--tls-key-file", key, "--tls-cert",
                   dir.File("old.pem"), "--check-config"});
  EXPECT_THAT(r.err, HasSubstr(cert));
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("old.pem")));
  EXPECT_EQ(CountLines(r.err, "--tls-cert is deprecated and ignored: --tls-cert-file is given too"), 1) << r.err;
  // The environment variable of the old name too.
  r = Shardcoordd({"--listen", "127.0.0.1:0", "--check-config"},
                  {"SHARDCOORD_DAEMON_TLS_CERT=" + cert, "SHARDCOORD_DAEMON_TLS_KEY_FILE=" + key});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr(cert));
  EXPECT_EQ(CountLines(r.err, "SHARDCOORD_DAEMON_TLS_CERT is deprecated: rename it SHARDCOORD_DAEMON_TLS_CERT_FILE"), 1)
      << r.err;
}

TEST(DaemonFlagsTest, FlagsWinOverTheEnvironmentWhichWinsOverTheConfigFile) {
  shardcoord::testing::TempDir dir;
  const std::string config = WriteConfig(dir, "listen: not-an-address\n");
  shardcoord::testing::RunResult r = Shardcoordd({"--config", config, "--check-config"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("listen 'not-an-address' is not HOST:PORT"));
  EXPECT_THAT(r.err, HasSubstr("(config key listen, flag --listen, environment SHARDCOORD_DAEMON_LISTEN)"));
  r = Shardcoordd({"--config", config, "--check-config"}, {"SHARDCOORD_DAEMON_LISTEN=127.0.0.1:0"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  r = Shardcoordd({"--config", config, "--listen", "127.0.0.1:0", "--check-config"},
                  {"SHARDCOORD_DAEMON_LISTEN=not-either"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

TEST(DaemonFlagsTest, ABadFlagValueNamesTheFlag) {
  shardcoord::testing::RunResult r =
      Shardcoordd({"--listen", "127.0.0.1:0", "--heartbeat-interval-ms", "abc", "--check-config"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err,
              HasSubstr("--heartbeat-interval-ms: 'abc' is of the wrong type (a whole number of ms expected)"));
  r = Shardcoordd({"--listen", "127.0.0.1:0", "--heartbeat-interval-ms", "5", "--check-config"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("heartbeat interval (5 ms) must be at least 10 ms (config key heartbeat_interval_ms, "
                               "flag --heartbeat-interval-ms)"));
  r = Shardcoordd({"--listen", "127.0.0.1:0", "--metrics-rank-series-max", "0", "--insecure", "--check-config"});
  EXPECT_EQ(r.exit_code, 0) << r.err;  // A key that had no flag before the table.
}

}  // namespace

// ---------------------------------------------------------------------------------------
// CheckServingNeeds: `shardcoordd --check-config` says OK only when a start would serve.

namespace {

using shardcoord::coordinator::CheckServingNeeds;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::SizeIs;

// A loopback TCP socket on a port the kernel picks: listening (another server holds the port),
// or bound with SO_REUSEADDR and not listening (it keeps the port from other programs while
// a listener of the check may still take it).
class TestSocket {
 public:
  explicit TestSocket(bool listening) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int one = 1;
    if (!listening) setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    const bool ok = fd_ >= 0 && bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                    (!listening || listen(fd_, 4) == 0) &&
                    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
    EXPECT_TRUE(ok) << "cannot make a loopback socket";
    port_ = ntohs(addr.sin_port);
  }
  ~TestSocket() { close(fd_); }
  TestSocket(const TestSocket&) = delete;
  TestSocket& operator=(const TestSocket&) = delete;
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// Settings that serve on loopback with every file the check looks at in `dir`.
CoordinatorOptions ServingOptions(const shardcoord::testing::TempDir& dir) {
  CoordinatorOptions o;
  o.listen_address = "127.0.0.1:0";
  o.http_listen = "127.0.0.1:0";
  o.journal_file = dir.File("events.db");
  o.state_file = dir.File("state");
  o.address_file = dir.File("address");
  return o;
}

TEST(CheckServingNeedsTest, LoopbackWithFilesInAWritableFolderWillStart) {
  shardcoord::testing::TempDir dir;
  EXPECT_THAT(CheckServingNeeds(ServingOptions(dir)), IsEmpty());
  // The check leaves nothing behind: the journal, state and key files are made at start.
  EXPECT_NE(access(dir.File("events.db").c_str(), F_OK), 0);
  EXPECT_NE(access(dir.File("state.key").c_str(), F_OK), 0);
}

TEST(CheckServingNeedsTest, TokensAndTlsThatLoadWillStart) {
  shardcoord::testing::TempDir dir;
  auto certs = shardcoord::testing::MakeCertificates(dir.path());
  ASSERT_TRUE(certs.ok()) << certs.status();
  CoordinatorOptions o = ServingOptions(dir);
  o.tls.cert_file = certs->server_cert;
  o.tls.key_file = certs->server_key;
  o.token_file = WriteConfig(dir, "rank 0123456789abcdef0123456789abcdef\n", "tokens");
  ASSERT_EQ(chmod(o.token_file.c_str(), 0600), 0);
  EXPECT_THAT(CheckServingNeeds(o), IsEmpty());
}

TEST(CheckServingNeedsTest, JournalInAMissingFolderNamesTheFolderAndTheFlag) {
  shardcoord::testing::TempDir dir;
  CoordinatorOptions o = ServingOptions(dir);
  o.journal_file = dir.File("no-such-folder/events.db");
  EXPECT_THAT(CheckServingNeeds(o),
              ElementsAre(AllOf(HasSubstr("journal file " + o.journal_file), HasSubstr(dir.File("no-such-folder")),
                                HasSubstr("does not exist"), HasSubstr("--journal-file"))));
}

TEST(CheckServingNeedsTest, JournalInAFolderThatTakesNoFilesIsRefused) {
  // /proc takes no new files, not even from root (a chmod'ed folder would not stop root).
  shardcoord::testing::TempDir dir;
  CoordinatorOptions o = ServingOptions(dir);
  o.journal_file = "/proc/self/events.db";
  EXPECT_THAT(CheckServingNeeds(o), ElementsAre(AllOf(HasSubstr("journal file /proc/self/events.db"),
                                                      HasSubstr("does not take new files"),
                                                      HasSubstr("--journal-file"))));
}

TEST(CheckServingNeedsTest, JournalInAReadOnlyFolderIsRefused) {
  if (geteuid() == 0) GTEST_SKIP() << "root writes into a mode 0555 folder; the /proc case above covers root";
  shardcoord::testing::TempDir dir;
  const std::string ro = dir.File("ro");
  ASSERT_EQ(mkdir(ro.c_str(), 0555), 0);
  CoordinatorOptions o = ServingOptions(dir);
  o.journal_file = ro + "/events.db";
  EXPECT_THAT(CheckServingNeeds(o), ElementsAre(AllOf(HasSubstr(o.journal_file), HasSubstr("does not take new files"),
                                                      HasSubstr("Permission denied"))));
}

TEST(CheckServingNeedsTest, JournalThatIsNotSqliteIsRefused) {
  shardcoord::testing::TempDir dir;
  CoordinatorOptions o = ServingOptions(dir);
  WriteConfig(dir, "not a database, but long enough to have a header\n", "events.db");
  EXPECT_THAT(CheckServingNeeds(o),
              ElementsAre(AllOf(HasSubstr(o.journal_file), HasSubstr("not an SQLite file"), HasSubstr("move it away"))));
}

TEST(CheckServingNeedsTest, StateFileBesideADamagedResumeKeyIsRefused) {
  shardcoord::testing::TempDir dir;
  CoordinatorOptions o = ServingOptions(dir);
  WriteConfig(dir, "not hex\n", "state.key");
  ASSERT_EQ(::chmod((o.state_file + ".key").c_str(), 0600), 0);  // A key file others may read is refused first.
  EXPECT_THAT(CheckServingNeeds(o), ElementsAre(AllOf(HasSubstr(o.state_file + ".key"), HasSubstr("delete it"))));
}

TEST(CheckServingNeedsTest, StateAndAddressFilesInMissingFoldersAreNamed) {
  shardcoord::testing::TempDir dir;
  CoordinatorOptions o = ServingOptions(dir);
  o.state_file = dir.File("gone/state");
  o.address_file = dir.File("gone/address");
  EXPECT_THAT(CheckServingNeeds(o), ElementsAre(AllOf(HasSubstr("state file"), HasSubstr("--state-file")),
                                                AllOf(HasSubstr("address file"), HasSubstr("--address-file"))));
}

TEST(CheckServingNeedsTest, GrpcPortHeldByAnotherServerIsNamed) {
  shardcoord::testing::TempDir dir;
  TestSocket other(/*listening=*/true);
  CoordinatorOptions o = ServingOptions(dir);
  o.listen_address = other.address();
  EXPECT_THAT(CheckServingNeeds(o),
              ElementsAre(AllOf(HasSubstr("listen " + other.address()), HasSubstr("port " + std::to_string(other.port())),
                                HasSubstr("already in use"), HasSubstr("--listen"))));
}

// gRPC binds [::] dual-stack, so an IPv4 server on the port stops it: the check must see that
// too (it once probed IPv6 only and said OK to a start that then failed).
TEST(CheckServingNeedsTest, TheIpv6WildcardSeesAnIpv4ServerOnThePort) {
  const int probe = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (probe < 0) GTEST_SKIP() << "no IPv6 on this host";
  close(probe);
  shardcoord::testing::TempDir dir;
  TestSocket other(/*listening=*/true);
  CoordinatorOptions o = ServingOptions(dir);
  o.listen_address = "[::]:" + std::to_string(other.port());
  EXPECT_THAT(CheckServingNeeds(o), ElementsAre(AllOf(HasSubstr("already in use"), HasSubstr("--listen"))));
}

TEST(CheckServingNeedsTest, HttpPortBoundByAnotherProgramIsNamed) {
  shardcoord::testing::TempDir dir;
  shardcoord::testing::RefusingPort bound;  // Bound, never listening: gRPC or asio could not bind it either.
  CoordinatorOptions o = ServingOptions(dir);
  o.http_listen = bound.address();
  EXPECT_THAT(CheckServingNeeds(o), ElementsAre(AllOf(HasSubstr("http_listen " + bound.address()),
                                                      HasSubstr("already in use"), HasSubstr("--http-listen"))));
}

TEST(CheckServingNeedsTest, HttpOnTheGrpcPortIsNamedAsSuch) {
  shardcoord::testing::TempDir dir;
  TestSocket reserved(/*listening=*/false);  // Keeps the port from others; the check may still listen on it.
  CoordinatorOptions o = ServingOptions(dir);
  o.listen_address = reserved.address();
  o.http_listen = reserved.address();
  EXPECT_THAT(CheckServingNeeds(o), ElementsAre(AllOf(HasSubstr("is the port of listen " + reserved.address()),
                                                      HasSubstr("different ports"))));
}

TEST(CheckServingNeedsTest, AnAddressOfAnotherHostIsNamed) {
  shardcoord::testing::TempDir dir;
  CoordinatorOptions o = ServingOptions(dir);
  o.listen_address = "192.0.2.1:0";  // TEST-NET-1: never an address of this host.
  o.insecure = true;
  EXPECT_THAT(CheckServingNeeds(o), ElementsAre(AllOf(HasSubstr("192.0.2.1 is not an address of this host"),
                                                      HasSubstr("--listen"))));
  o.listen_address = "127.0.0.1:0";
  o.http_listen = "no-such-host.invalid:0";
  EXPECT_THAT(CheckServingNeeds(o), ElementsAre(AllOf(HasSubstr("is not an IP address"), HasSubstr("--http-listen"))));
}

TEST(CheckServingNeedsTest, UnreadableSecretsAreNamedEachOnItsOwn) {
  shardcoord::testing::TempDir dir;
  CoordinatorOptions o = ServingOptions(dir);
  o.token_file = dir.File("no-tokens");
  o.tls.cert_file = dir.File("no-cert.pem");
  o.tls.key_file = dir.File("no-key.pem");
  o.journal_file = dir.File("gone/events.db");
  const std::vector<std::string> problems = CheckServingNeeds(o);
  ASSERT_THAT(problems, SizeIs(3)) << ::testing::PrintToString(problems);
  EXPECT_THAT(problems[0], HasSubstr("no-cert.pem"));
  EXPECT_THAT(problems[1], HasSubstr("no-tokens"));
  EXPECT_THAT(problems[2], HasSubstr("gone/events.db"));
}

}  // namespace
