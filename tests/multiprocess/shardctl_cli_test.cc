// shardctl on bad input: the real binary, and a real shardcoordd where a coordinator answers.
// The rule: 0 ok; 1 the coordinator answered but the request failed (no such job); 2 usage,
// bad input, or the coordinator unreachable. Every error is a readable line on stderr.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <tuple>

#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "support/daemon.h"
#include "support/subprocess.h"
#include "support/test_env.h"

namespace shardcoord {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using testing::RunCommand;
using testing::TempDir;

constexpr absl::Duration kCommandTimeout = absl::Seconds(30);
const std::vector<std::string> kQueries = {"status", "ranks", "groups", "decisions", "comms", "events"};

// `microbatches` lines per rank of ranks 0..world-1.
void WriteTrace(const std::string& path, int world, int microbatches) {
  std::ofstream out(path);
  for (int i = 0; i < microbatches; ++i) {
    for (int r = 0; r < world; ++r) {
      out << "{\"rank\":" << r << ",\"step\":0,\"microbatch\":" << i << ",\"calls\":{\"vision_tower\":" << (i % 2)
          << "}}\n";
    }
  }
}

std::vector<std::string> Shardctl(std::vector<std::string> args) {
  args.insert(args.begin(), SHARDCTL_PATH);
  return args;
}

// A job of 2 ranks replayed to its end through the coordinator at `address` (its ranks left;
// the job is retained).
void ReplayJob(TempDir& dir, const std::string& address, const std::string& job) {
  const std::string trace = dir.File(job + ".jsonl");
  WriteTrace(trace, 2, 4);
  auto replay = RunCommand(Shardctl({"replay", trace, "--coordinator", address, "--job-id", job,
                                     "--decision-timeout-ms", "30000"}),
                           absl::Seconds(60));
  ASSERT_EQ(replay.exit_code, 0) << replay.err;
}

TEST(ShardctlCliTest, BadCoordinatorAddressIsAUsageErrorForEveryCommand) {
  TempDir dir;
  const std::string trace = dir.File("trace.jsonl");
  WriteTrace(trace, 2, 2);
  for (const std::string bad : {"127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1", ":7871",
                                "127.0.0.1:", "127.0.0.1:abc", "127.0.0.1:+80", "::1:7871", "[::1]", "[]:7871",
                                "[::1]7871", "dns:///127.0.0.1:7871"}) {
    std::vector<std::vector<std::string>> commands;
    for (const auto& q : kQueries) commands.push_back({q, "--coordinator", bad, "--timeout-ms", "2000"});
    commands.push_back({"replay", trace, "--coordinator", bad, "--connect-timeout-ms", "2000"});
    for (const auto& args : commands) {
      auto r = RunCommand(Shardctl(args), kCommandTimeout);
      EXPECT_EQ(r.exit_code, 2) << args[0] << " " << bad << ": " << r.err;
      EXPECT_THAT(r.err, AllOf(HasSubstr("--coordinator '" + bad + "'"), HasSubstr("HOST:PORT"),
                               HasSubstr("1..65535")))
          << args[0];
      EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "one line: " << r.err;
      EXPECT_THAT(r.out, IsEmpty());
    }
  }
  // $SHARDCOORD_ADDR is checked the same way, and the error names it.
  for (const std::string cmd : {"status", "events"}) {
    auto r = RunCommand(Shardctl({cmd}), kCommandTimeout, {"SHARDCOORD_ADDR=127.0.0.1:99999"});
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_THAT(r.err, HasSubstr("SHARDCOORD_ADDR '127.0.0.1:99999'"));
  }
  // `verify` talks to no coordinator: a bad $SHARDCOORD_ADDR is none of its business.
  std::ofstream(dir.File("rank0.jsonl"))
      << R"({"rank":0,"group":0,"step":0,"microbatch":0,"module":"m","decision":"skip","seq":1,"reason":"x"})"
      << "\n";
  auto verify = RunCommand(Shardctl({"verify", dir.File("rank0.jsonl")}), kCommandTimeout,
                           {"SHARDCOORD_ADDR=127.0.0.1:99999"});
  EXPECT_EQ(verify.exit_code, 0) << verify.err;
}

TEST(ShardctlCliTest, VerifyFailsWhenARankLacksDecisionsItsGroupMatesReceived) {
  TempDir dir;
  // A rank whose output lacks microbatches its group mates received does not pass as agreeing
  // (it did: "all ranks of each group agree" with one rank holding 1 of 3 decisions).
  auto line = [](int rank, int mb) {
    return absl::StrCat(R"({"rank":)", rank, R"(,"group":0,"step":0,"microbatch":)", mb,
                        R"(,"module":"m","decision":"skip","seq":)", mb, R"(,"reason":"x"})", "\n");
  };
  std::ofstream(dir.File("r0.jsonl")) << line(0, 0) << line(0, 1) << line(0, 2);
  std::ofstream(dir.File("r1.jsonl")) << line(1, 0);
  // By default counted and named (a killed rank lacks what came after its end)...
  auto noted = RunCommand(Shardctl({"verify", dir.File("r0.jsonl"), dir.File("r1.jsonl")}), kCommandTimeout);
  EXPECT_EQ(noted.exit_code, 0) << noted.out << noted.err;
  EXPECT_THAT(noted.err, HasSubstr("note: rank 1 of group 0 has no decision for (0,1) module m"));
  EXPECT_THAT(noted.out, HasSubstr("all ranks of each group agree (2 decisions lacking from some rank's output"));
  // ...and with --complete a failure.
  auto partial =
      RunCommand(Shardctl({"verify", "--complete", dir.File("r0.jsonl"), dir.File("r1.jsonl")}), kCommandTimeout);
  EXPECT_EQ(partial.exit_code, 3) << partial.out << partial.err;
  EXPECT_THAT(partial.err, HasSubstr("MISSING: rank 1 of group 0 has no decision for (0,1) module m"));
  auto whole = RunCommand(Shardctl({"verify", dir.File("r0.jsonl")}), kCommandTimeout);
  EXPECT_EQ(whole.exit_code, 0) << whole.err;
  EXPECT_THAT(partial.out, HasSubstr("2 decisions MISSING"));
}

TEST(ShardctlCliTest, VerifyComparesAPaddedDecisionsPasses) {
  TempDir dir;
  auto line = [](int rank, int calls) {
    return absl::StrCat(R"({"rank":)", rank, R"(,"group":0,"step":0,"microbatch":0,"module":"m","decision":"padded",)",
                        R"("seq":0,"reason":"divergent","calls":)", calls, "}\n");
  };
  std::ofstream(dir.File("r0.jsonl")) << line(0, 2);
  std::ofstream(dir.File("r1.jsonl")) << line(1, 3);
  std::ofstream(dir.File("r2.jsonl")) << line(2, 2);
  auto diverged = RunCommand(Shardctl({"verify", dir.File("r0.jsonl"), dir.File("r1.jsonl")}), kCommandTimeout);
  EXPECT_EQ(diverged.exit_code, 3) << diverged.out << diverged.err;
  EXPECT_THAT(diverged.err, HasSubstr("rank 0 got padded (2 passes) seq 0, rank 1 got padded (3 passes) seq 0"));
  auto agree = RunCommand(Shardctl({"verify", dir.File("r0.jsonl"), dir.File("r2.jsonl")}), kCommandTimeout);
  EXPECT_EQ(agree.exit_code, 0) << agree.out << agree.err;
}

// A number out of its field's range, a fraction or one past int64 (which the JSON library
// holds as a double) is not a per-rank line: named with its file and line, never cast.
TEST(ShardctlCliTest, VerifyRefusesAnOutOfRangeNumberNamingTheLine) {
  TempDir dir;
  for (const std::string bad : {"1e300", "2.5", "4294967296"}) {
    SCOPED_TRACE(bad);
    std::ofstream(dir.File("r0.jsonl"), std::ios::trunc)
        << R"({"rank":0,"group":0,"step":0,"microbatch":)" << bad
        << R"(,"module":"m","decision":"skip","seq":0,"reason":"x"})" << "\n";
    auto r = RunCommand(Shardctl({"verify", dir.File("r0.jsonl")}), kCommandTimeout);
    EXPECT_NE(r.exit_code, 0) << r.out;
    EXPECT_THAT(r.err, HasSubstr(dir.File("r0.jsonl") + ":1: not a `shardctl replay --per-rank` line"));
    EXPECT_THAT(r.err, HasSubstr("'microbatch' is "));
  }
}

// The probes: rank -5 and group -1 accepted, escape sequences from a file written raw to the
// terminal, /dev/zero read as empty with rc 0, "all ranks agree" for two outputs sharing nothing.
TEST(ShardctlCliTest, VerifyRefusesNegativesEscapesDevicesAndOutputsThatShareNothing) {
  TempDir dir;
  auto line = [](const std::string& rank, const std::string& group, const std::string& module) {
    return absl::StrCat(R"({"rank":)", rank, R"(,"group":)", group, R"(,"step":0,"microbatch":0,"module":")", module,
                        R"(","decision":"skip","seq":0,"reason":"x"})", "\n");
  };
  for (const auto& [rank, group, says] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"-5", "0", "'rank' is -5, not an integer in 0.."}, {"0", "-1", "'group' is -1, not an integer in 0.."}}) {
    std::ofstream(dir.File("neg.jsonl"), std::ios::trunc) << line(rank, group, "m");
    auto r = RunCommand(Shardctl({"verify", dir.File("neg.jsonl")}), kCommandTimeout);
    EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr(says));
  }
  std::ofstream(dir.File("e0.jsonl")) << line("0", "0", "\\u001b[2J\\u009b31m");
  std::ofstream(dir.File("e1.jsonl")) << R"({"rank":1,"group":0,"step":0,"microbatch":0,"module":"\u001b[2J\u009b31m",)"
                                      << R"("decision":"root","seq":0,"reason":"x"})" << "\n";
  auto escaped = RunCommand(Shardctl({"verify", dir.File("e0.jsonl"), dir.File("e1.jsonl")}), kCommandTimeout);
  EXPECT_EQ(escaped.exit_code, 3) << escaped.out << escaped.err;
  EXPECT_THAT(escaped.err, HasSubstr("module \\x1b[2J\\xc2\\x9b31m"));
  EXPECT_EQ(escaped.err.find('\x1b'), std::string::npos) << "an escape sequence reached the terminal";
  auto device = RunCommand(Shardctl({"verify", "/dev/zero"}), kCommandTimeout);
  EXPECT_EQ(device.exit_code, 2) << device.out << device.err;
  EXPECT_THAT(device.err, HasSubstr("/dev/zero is not a regular file"));
  std::ofstream(dir.File("a.jsonl")) << line("0", "0", "vision");
  std::ofstream(dir.File("b.jsonl")) << line("1", "0", "audio");
  auto disjoint = RunCommand(Shardctl({"verify", dir.File("a.jsonl"), dir.File("b.jsonl")}), kCommandTimeout);
  EXPECT_EQ(disjoint.exit_code, 2) << disjoint.out << disjoint.err;
  EXPECT_THAT(disjoint.err, HasSubstr("share no decision"));
  EXPECT_THAT(disjoint.out, ::testing::Not(HasSubstr("agree")));
}

TEST(ShardctlCliTest, BothProgramsSayTheirVersion) {
  for (const std::string& program : {std::string(SHARDCTL_PATH), std::string(SHARDCOORDD_PATH)}) {
    auto r = RunCommand({program, "--version"}, kCommandTimeout);
    EXPECT_EQ(r.exit_code, 0) << program << ": " << r.err;
    EXPECT_THAT(r.out, ::testing::MatchesRegex("(shardctl|shardcoordd) [0-9]+\\.[0-9]+\\.[0-9]+\n")) << r.out;
  }
}

TEST(ShardctlCliTest, WellFormedAddressesAreAccepted) {
  testing::RefusingPort closed;
  const std::string port = std::to_string(closed.port());
  for (const std::string& good : {closed.address(), "localhost:" + port, "[::1]:" + port}) {
    auto r = RunCommand(Shardctl({"status", "--coordinator", good, "--timeout-ms", "2000"}), kCommandTimeout);
    // Nothing serves there: the address passes the check and the query fails as unreachable.
    EXPECT_THAT(r.err, Not(HasSubstr("not a coordinator address"))) << good;
    EXPECT_THAT(r.err, HasSubstr("cannot reach coordinator at " + good)) << good;
    EXPECT_EQ(r.exit_code, 2) << good;
  }
}

TEST(ShardctlCliTest, AJobThatDoesNotExistIsExitOneForEveryQuery) {
  TempDir dir;
  auto daemon = testing::Daemon::Start(dir.path(), {});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string address = (*daemon)->address();
  ASSERT_NO_FATAL_FAILURE(ReplayJob(dir, address, "known"));

  for (const auto& q : kQueries) {
    for (bool json : {false, true}) {
      std::vector<std::string> args = {q, "--coordinator", address, "--job", "nosuch"};
      if (json) args.push_back("--json");
      auto r = RunCommand(Shardctl(args), kCommandTimeout);
      EXPECT_EQ(r.exit_code, 1) << q << " json=" << json << ": " << r.err;
      EXPECT_THAT(r.err, HasSubstr("has no job 'nosuch'")) << q;
      EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "one line: " << r.err;
      EXPECT_THAT(r.out, IsEmpty()) << q;
    }
    // The job that exists answers 0, also where it has no rows (no communicators).
    auto ok = RunCommand(Shardctl({q, "--coordinator", address, "--job", "known"}), kCommandTimeout);
    EXPECT_EQ(ok.exit_code, 0) << q << ": " << ok.err;
    EXPECT_THAT(ok.err, IsEmpty()) << q;
    // No --job: every job, never "no job".
    auto all = RunCommand(Shardctl({q, "--coordinator", address}), kCommandTimeout);
    EXPECT_EQ(all.exit_code, 0) << q << ": " << all.err;
  }
  auto events = RunCommand(Shardctl({"events", "--coordinator", address, "--job", "known"}), kCommandTimeout);
  EXPECT_THAT(events.out, HasSubstr("job=known"));
}

// `shardctl watch`: plain frames when output is not a terminal; on a terminal (a pty from
// script(1)) the alternate screen, redrawn in place, left again on `q`.
TEST(ShardctlCliTest, WatchDrawsFramesAndQuitsOnQ) {
  TempDir dir;
  auto daemon = testing::Daemon::Start(dir.path(), {});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string address = (*daemon)->address();
  ASSERT_NO_FATAL_FAILURE(ReplayJob(dir, address, "watched"));
  auto plain = RunCommand(Shardctl({"watch", "--coordinator", address, "--count", "2", "--interval-ms", "100"}),
                          kCommandTimeout);
  EXPECT_EQ(plain.exit_code, 0) << plain.err;
  size_t frames = 0;
  for (size_t at = plain.out.find("shardcoord "); at != std::string::npos; at = plain.out.find("shardcoord ", at + 1)) {
    frames++;
  }
  EXPECT_EQ(frames, 2u) << plain.out;
  EXPECT_THAT(plain.out, HasSubstr("JOB watched"));
  EXPECT_EQ(plain.out.find('\x1b'), std::string::npos) << "escape sequences in plain output";
  // On a terminal, until `q`.
  const std::string cmd = absl::StrCat(SHARDCTL_PATH, " watch --coordinator ", address, " --interval-ms 100");
  auto tty = RunCommand({"/bin/sh", "-c", "printf q | script -qfec '" + cmd + "' /dev/null"}, kCommandTimeout);
  EXPECT_EQ(tty.exit_code, 0) << tty.err;
  EXPECT_THAT(tty.out, HasSubstr("\x1b[?1049h"));  // Alternate screen on ...
  EXPECT_THAT(tty.out, HasSubstr("JOB watched"));
  EXPECT_THAT(tty.out, HasSubstr("\x1b[?1049l"));  // ... and off again.
}

// The event journal in SQLite (--journal-file): a job's events survive a daemon restart and
// `shardctl events` filters them by job, kind and time.
TEST(ShardctlCliTest, JournalEventsSurviveARestartAndAreFiltered) {
  TempDir dir;
  const std::string journal = dir.File("events.db");
  std::string address;
  {
    auto daemon = testing::Daemon::Start(dir.path(), {"--journal-file", journal}, "127.0.0.1:0", "first");
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    address = (*daemon)->address();
    ASSERT_NO_FATAL_FAILURE(ReplayJob(dir, address, "yesterday"));
    (*daemon)->process().Signal(SIGTERM);  // A clean stop writes the journal out.
    ASSERT_EQ((*daemon)->process().Wait(absl::Seconds(20)), 0) << (*daemon)->Stderr();
  }
  auto daemon = testing::Daemon::Start(dir.path(), {"--journal-file", journal}, "127.0.0.1:0", "second");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  address = (*daemon)->address();
  auto all = RunCommand(Shardctl({"events", "--coordinator", address, "--job", "yesterday"}), kCommandTimeout);
  EXPECT_EQ(all.exit_code, 0) << all.err;
  EXPECT_THAT(all.out, HasSubstr("rank_registered"));
  EXPECT_THAT(all.out, HasSubstr("rank_left"));
  auto kind = RunCommand(Shardctl({"events", "--coordinator", address, "--job", "yesterday", "--kind",
                                   "rank_registered", "--json"}),
                         kCommandTimeout);
  EXPECT_EQ(kind.exit_code, 0) << kind.err;
  EXPECT_THAT(kind.out, HasSubstr("\"kind\":\"rank_registered\""));
  EXPECT_THAT(kind.out, Not(HasSubstr("rank_left")));
  auto recent = RunCommand(Shardctl({"events", "--coordinator", address, "--since", "1h", "--job", "yesterday"}),
                           kCommandTimeout);
  EXPECT_THAT(recent.out, HasSubstr("rank_registered"));
  auto future = RunCommand(Shardctl({"events", "--coordinator", address, "--since", "2099-01-01T00:00:00Z"}),
                           kCommandTimeout);
  EXPECT_EQ(future.exit_code, 0) << future.err;
  EXPECT_THAT(future.out, Not(HasSubstr("rank_registered")));
  auto bad = RunCommand(Shardctl({"events", "--coordinator", address, "--since", "yesterday"}), kCommandTimeout);
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.err, HasSubstr("--since 'yesterday' is neither a duration"));
  // A file that is not a journal: refused at start, naming it.
  const std::string junk = dir.File("junk.db");
  std::ofstream(junk) << std::string(4096, 'x');
  auto refused = RunCommand({SHARDCOORDD_PATH, "--listen", "127.0.0.1:0", "--journal-file", junk}, kCommandTimeout);
  EXPECT_EQ(refused.exit_code, 2);
  EXPECT_THAT(refused.err, HasSubstr("journal file " + junk));
}

TEST(ShardctlCliTest, OutOfRangeTimeoutsAndLimitsSayTheRange) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"status", "--timeout-ms", "0"},
           {"--timeout-ms", "-5", "ranks"},
           {"groups", "--timeout-ms", "86400001"},
           {"decisions", "--limit", "0"},
           {"events", "--limit", "-1"}}) {
    auto r = RunCommand(Shardctl(args), kCommandTimeout);
    const std::string& flag = args[0] == "--timeout-ms" ? args[0] : args[1];
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_THAT(r.err, AllOf(HasSubstr(flag), HasSubstr("not in range 1 to ")));
    // A readable range, not numeric_limits<double>.
    EXPECT_LT(r.err.size(), 200u) << r.err;
    EXPECT_THAT(r.err, Not(HasSubstr("00000000000000000000")));
  }
  auto r = RunCommand(Shardctl({"status", "--timeout-ms", "0"}), kCommandTimeout);
  EXPECT_THAT(r.err, HasSubstr("1 to 86400000"));
}

TEST(ShardctlCliTest, AnUnknownCommandIsNamedWithTheCommands) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"bogus"}, {"--coordinator", "127.0.0.1:7871", "bogus"}, {"bogus", "--json"}}) {
    auto r = RunCommand(Shardctl(args), kCommandTimeout);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_THAT(r.err, HasSubstr("unknown command 'bogus'"));
    for (const char* cmd : {"status", "ranks", "groups", "decisions", "comms", "events", "replay", "verify"}) {
      EXPECT_THAT(r.err, HasSubstr(cmd));
    }
    EXPECT_THAT(r.err, Not(HasSubstr("A subcommand is required")));
  }
  auto none = RunCommand(Shardctl({}), kCommandTimeout);
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_THAT(none.err, AllOf(HasSubstr("no command given"), HasSubstr("status")));
  auto help = RunCommand(Shardctl({"--help"}), kCommandTimeout);
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_THAT(help.out, HasSubstr("replay"));
}

// Without --coordinator the replay starts a shardcoordd of its own, as a child process: the
// daemon's own settings in the environment do not reach it, and one that cannot start is named
// with the reason, never waited on.
TEST(ShardctlCliTest, ReplayStartsADaemonOfItsOwnAndSaysWhyWhenItCannot) {
  TempDir dir;
  const std::string trace = dir.File("t.jsonl");
  std::ofstream(trace) << "{\"rank\":0,\"step\":0,\"microbatch\":0,\"calls\":{\"m\":1}}\n"
                       << "{\"rank\":1,\"step\":0,\"microbatch\":0,\"calls\":{\"m\":1}}\n";
  // An operator's daemon setting that would stop any shardcoordd from listening: not passed on.
  auto r = RunCommand(Shardctl({"replay", trace, "--daemon", SHARDCOORDD_PATH}), kCommandTimeout,
                      {"SHARDCOORD_DAEMON_LISTEN=not-an-address", "SHARDCOORD_DAEMON_MAX_WORLD_SIZE=1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("\"decision\":\"per_layer\""));
  // Found without --daemon too: $SHARDCOORDD (a wrapper that says it ran, so the build tree's
  // daemon beside shardctl cannot pass for it).
  ::unsetenv("SHARDCOORDD");  // The test's own environment must not decide which one is found.
  const std::string wrapper = dir.File("wrapper.sh"), marker = dir.File("wrapper-ran");
  std::ofstream(wrapper) << "#!/bin/sh\ntouch '" << marker << "'\nexec '" << SHARDCOORDD_PATH << "' \"$@\"\n";
  ::chmod(wrapper.c_str(), 0700);
  auto found = RunCommand(Shardctl({"replay", trace}), kCommandTimeout, {"SHARDCOORDD=" + wrapper});
  EXPECT_EQ(found.exit_code, 0) << found.err;
  EXPECT_TRUE(std::ifstream(marker).good()) << "$SHARDCOORDD was not the daemon started";

  auto missing = RunCommand(Shardctl({"replay", trace, "--daemon", dir.File("none")}), kCommandTimeout);
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_THAT(missing.err, HasSubstr("--daemon " + dir.File("none") + " is not an executable file"));
  auto bad_env = RunCommand(Shardctl({"replay", trace}), kCommandTimeout, {"SHARDCOORDD=" + dir.File("none")});
  EXPECT_EQ(bad_env.exit_code, 1);
  EXPECT_THAT(bad_env.err, HasSubstr("$SHARDCOORDD (" + dir.File("none") + ") is not an executable file"));
  // A daemon that exits at once: its exit code and its log's last lines, at once.
  const std::string failing = dir.File("failing.sh");
  std::ofstream(failing) << "#!/bin/sh\necho 'cannot listen: port taken' >&2\nexit 2\n";
  ::chmod(failing.c_str(), 0700);
  const absl::Time start = absl::Now();
  auto exited = RunCommand(Shardctl({"replay", trace, "--daemon", failing}), kCommandTimeout);
  EXPECT_EQ(exited.exit_code, 1);
  EXPECT_THAT(exited.err, AllOf(HasSubstr("exited with 2 before serving"), HasSubstr("cannot listen: port taken")));
  EXPECT_LT(absl::Now() - start, testing::kLoadSlack);
  // One that never serves: bounded by --connect-timeout-ms.
  const std::string silent = dir.File("silent.sh");
  std::ofstream(silent) << "#!/bin/sh\nexec sleep 60\n";
  ::chmod(silent.c_str(), 0700);
  auto hung = RunCommand(Shardctl({"replay", trace, "--daemon", silent, "--connect-timeout-ms", "1000"}),
                         kCommandTimeout);
  EXPECT_EQ(hung.exit_code, 1);
  EXPECT_THAT(hung.err, HasSubstr("did not serve within 1s"));
  // A file that cannot be executed: exec's errno in the message.
  const std::string text = dir.File("text.txt");
  std::ofstream(text) << "not a program\n";
  ::chmod(text.c_str(), 0700);
  auto noexec = RunCommand(Shardctl({"replay", trace, "--daemon", text}), kCommandTimeout);
  EXPECT_EQ(noexec.exit_code, 1);
  EXPECT_THAT(noexec.err, AllOf(HasSubstr("exited with 127"), HasSubstr("cannot execute it: errno 8")));
}

TEST(ShardctlCliTest, ReplayRefusesMoreRanksThanOneProcessCanRun) {
  TempDir dir;
  const std::string trace = dir.File("big.jsonl");
  std::ofstream(trace) << "{\"rank\":0,\"step\":0,\"microbatch\":0,\"calls\":{\"m\":1}}\n"
                       << "{\"rank\":100000,\"step\":0,\"microbatch\":0,\"calls\":{\"m\":1}}\n";
  const absl::Time start = absl::Now();
  auto r = RunCommand(Shardctl({"replay", trace}), kCommandTimeout);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, AllOf(HasSubstr("100001 ranks to simulate"), HasSubstr("4096"), HasSubstr("--ranks")));
  EXPECT_LT(absl::Now() - start, testing::kLoadSlack) << "refused before starting anything";
  // A subset within the cap is not refused for its size (it plays ranks 0 and 1 of a world
  // of 100001; the embedded coordinator's default max_world_size refuses that world).
  auto subset = RunCommand(Shardctl({"replay", trace, "--ranks", "0,1", "--connect-timeout-ms", "5000"}),
                           absl::Seconds(60));
  EXPECT_THAT(subset.err, Not(HasSubstr("ranks to simulate"))) << subset.err;
  // A rank near INT32_MAX does not overflow the world size.
  std::ofstream(dir.File("huge.jsonl")) << "{\"rank\":2147483647,\"step\":0,\"microbatch\":0}\n";
  auto huge = RunCommand(Shardctl({"replay", dir.File("huge.jsonl")}), kCommandTimeout);
  EXPECT_EQ(huge.exit_code, 2) << huge.err;
  EXPECT_THAT(huge.err, HasSubstr("the trace names rank 2147483647"));
}

TEST(ShardctlCliTest, ReplayReportsThreadsItCannotStart) {
#ifdef SHARDCOORD_SANITIZED
  GTEST_SKIP() << "AddressSanitizer reserves terabytes of shadow address space: it cannot start under ulimit -v";
#endif
  // 3000 ranks (under the cap) in an address space too small for their thread stacks:
  // thread creation fails part way, which is an error message, not std::terminate.
  TempDir dir;
  const std::string trace = dir.File("wide.jsonl");
  WriteTrace(trace, 3000, 1);
  testing::RefusingPort closed;
  auto r = RunCommand({"/bin/sh", "-c",
                       absl::StrCat("ulimit -v 1500000 && exec ", SHARDCTL_PATH, " replay ", trace,
                                    " --coordinator ", closed.address(), " --connect-timeout-ms 2000")},
                      absl::Seconds(120));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, AllOf(HasSubstr("cannot start the thread of rank"), HasSubstr("--ranks")));
  EXPECT_THAT(r.err, Not(HasSubstr("terminate")));
}

}  // namespace
}  // namespace shardcoord
