// The event journal's SQLite store and its writer: real files in a temporary folder.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <climits>
#include <fstream>

#include "coordinator/journal/event_journal.h"
#include "coordinator/journal/journal_store.h"
#include "support/test_env.h"

namespace shardcoord::coordinator {
namespace {

using ::testing::HasSubstr;

v1::Event At(uint64_t id, int64_t unix_ms, const std::string& job, const std::string& kind) {
  v1::Event e;
  e.set_id(id);
  e.set_unix_ms(unix_ms);
  e.set_severity("info");
  e.set_kind(kind);
  e.set_job_id(job);
  e.set_rank(-1);
  e.set_group(-1);
  e.set_message("m" + std::to_string(id));
  return e;
}

std::vector<uint64_t> Ids(const std::vector<v1::Event>& events) {
  std::vector<uint64_t> out;
  for (const auto& e : events) out.push_back(e.id());
  return out;
}

TEST(JournalStoreTest, QueriesFilterByJobKindTimeAndCursor) {
  testing::TempDir dir;
  auto store = JournalStore::Open(dir.File("j.db"));
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->Append({At(1, 1000, "a", "rank_registered"), At(2, 2000, "b", "rank_registered"),
                                At(3, 3000, "a", "rank_dead"), At(4, 4000, "a", "rank_registered")})
                  .ok());
  EXPECT_EQ((*store)->MaxId(), 4u);
  EXPECT_THAT(Ids((*store)->Query({"a", "", 0, 0, 10})), ::testing::ElementsAre(1, 3, 4));
  EXPECT_THAT(Ids((*store)->Query({"", "rank_registered", 0, 0, 10})), ::testing::ElementsAre(1, 2, 4));
  EXPECT_THAT(Ids((*store)->Query({"", "", 2500, 0, 10})), ::testing::ElementsAre(3, 4));
  EXPECT_THAT(Ids((*store)->Query({"", "", 0, 0, 2})), ::testing::ElementsAre(3, 4));  // The newest two.
  EXPECT_THAT(Ids((*store)->Query({"", "", 0, 1, 2})), ::testing::ElementsAre(2, 3));  // The two after id 1.
  // Pruning by age, then by count.
  EXPECT_EQ((*store)->Prune(absl::FromUnixMillis(1500) + absl::Hours(1), absl::Hours(1), 100), 1);
  EXPECT_EQ((*store)->Prune(absl::FromUnixMillis(0), absl::Hours(1), 2), 1);
  EXPECT_THAT(Ids((*store)->Query({"", "", 0, 0, 10})), ::testing::ElementsAre(3, 4));
}

TEST(JournalStoreTest, AFileThatIsNotAJournalIsRefusedNamingIt) {
  testing::TempDir dir;
  const std::string path = dir.File("junk.db");
  std::ofstream(path) << std::string(4096, 'x');
  auto store = JournalStore::Open(path);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(store.status().message(), HasSubstr("journal file " + path));
  EXPECT_THAT(store.status().message(), HasSubstr("give another --journal-file"));
  EXPECT_FALSE(JournalStore::Open(dir.File("no/such/folder/j.db")).ok());
}

// The review's journals: one whose newest id is 2^63-1 hid every new event; a damaged page was
// accepted with a rate-limited warning. Both are refused at open, naming the file.
TEST(JournalStoreTest, AJournalWithNoRoomForNewIdsIsRefused) {
  testing::TempDir dir;
  const std::string path = dir.File("j.db");
  {
    auto store = JournalStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->Append({At(1, 1000, "a", "k"), At(uint64_t{INT64_MAX}, 2000, "a", "k")}).ok());
  }
  auto reopened = JournalStore::Open(path);
  ASSERT_FALSE(reopened.ok());
  EXPECT_EQ(reopened.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(reopened.status().message(), HasSubstr("journal file " + path));
  EXPECT_THAT(reopened.status().message(), HasSubstr("past 2^62"));
}

TEST(JournalStoreTest, ADamagedJournalIsRefusedNamingIt) {
  testing::TempDir dir;
  const std::string path = dir.File("j.db");
  {
    auto store = JournalStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    std::vector<v1::Event> events;
    for (uint64_t id = 1; id <= 3000; ++id) {
      events.push_back(At(id, 1000 + static_cast<int64_t>(id), "job", "rank_registered"));
      events.back().set_message(std::string(200, 'm'));
    }
    ASSERT_TRUE((*store)->Append(events).ok());
  }  // Closed: the WAL is checkpointed into the file.
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(0, std::ios::end);
  const std::streamoff size = f.tellp();
  ASSERT_GT(size, 16 * 4096) << "too few pages to damage one in the middle";
  f.seekp(size / 2 / 4096 * 4096);  // A whole page in the middle of the table, overwritten.
  const std::string garbage(4096, '\xA5');
  f.write(garbage.data(), static_cast<std::streamsize>(garbage.size()));
  f.close();
  auto reopened = JournalStore::Open(path);
  ASSERT_FALSE(reopened.ok());
  EXPECT_THAT(reopened.status().message(), HasSubstr("journal file " + path + " is damaged"));
  EXPECT_THAT(reopened.status().message(), HasSubstr("give another --journal-file"));
}

TEST(EventJournalTest, EventsSurviveAndIdsContinueAcrossAReopen) {
  testing::TempDir dir;
  const std::string path = dir.File("j.db");
  {
    EventJournal j(2);  // Two in memory; the file keeps all.
    ASSERT_TRUE(j.Persist(path, absl::Hours(24), 1000).ok());
    for (int i = 0; i < 5; ++i) j.Add(absl::Now(), Severity::kInfo, EventKind::kRankRegistered, "a", i, 0, "hello");
    j.Flush();
    EXPECT_EQ(j.List({"a", "", 0, 0, 100}).size(), 5u);
  }
  EventJournal again(2);
  ASSERT_TRUE(again.Persist(path, absl::Hours(24), 1000).ok());
  again.Add(absl::Now(), Severity::kWarning, EventKind::kRankDead, "a", 0, 0, "gone");
  // Before and after the writer wrote it, the new event is listed after the old ones.
  auto listed = again.List({"a", "", 0, 0, 100});
  ASSERT_EQ(listed.size(), 6u);
  EXPECT_EQ(listed.back().id(), 6u);
  EXPECT_EQ(listed.back().kind(), "rank_dead");
  again.Flush();
  EXPECT_THAT(Ids(again.List({"", "rank_dead", 0, 0, 100})), ::testing::ElementsAre(6));
  EXPECT_THAT(Ids(again.List({"", "", 0, 4, 100})), ::testing::ElementsAre(5, 6));
}

// Ids go on after a restart even when retention pruned every old event, so that a reader's
// `after_id` cursor never sees ids reused.
TEST(EventJournalTest, IdsGoOnWhenEveryOldEventWasPruned) {
  testing::TempDir dir;
  const std::string path = dir.File("j.db");
  {
    EventJournal j(10);
    ASSERT_TRUE(j.Persist(path, absl::Hours(24), 1000).ok());
    for (int i = 0; i < 3; ++i) {
      j.Add(absl::Now() - absl::Hours(48), Severity::kInfo, EventKind::kRankLeft, "a", i, 0, "two days ago");
    }
    j.Flush();
  }
  EventJournal again(10);
  ASSERT_TRUE(again.Persist(path, absl::Hours(24), 1000).ok());
  EXPECT_TRUE(again.List({"", "rank_left", 0, 0, 100}).empty()) << "older than the retention: pruned";
  again.Add(absl::Now(), Severity::kInfo, EventKind::kRankRegistered, "a", 0, 0, "now");
  auto listed = again.List({"", "", 0, 0, 100});
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].id(), 4u);
}

}  // namespace
}  // namespace shardcoord::coordinator
