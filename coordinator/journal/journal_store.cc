#include "coordinator/journal/journal_store.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace shardcoord::coordinator {
namespace {

constexpr char kSchema[] =
    "CREATE TABLE IF NOT EXISTS shardcoord_events ("
    " id INTEGER PRIMARY KEY, unix_ms INTEGER NOT NULL, severity TEXT NOT NULL, kind TEXT NOT NULL,"
    " job_id TEXT NOT NULL, rank INTEGER NOT NULL, grp INTEGER NOT NULL, message TEXT NOT NULL);"
    "CREATE INDEX IF NOT EXISTS shardcoord_events_time ON shardcoord_events(unix_ms);"
    "CREATE INDEX IF NOT EXISTS shardcoord_events_job ON shardcoord_events(job_id, id);";

// A prepared statement, finalized on scope exit.
class Statement {
 public:
  Statement(sqlite3* db, const char* sql) { sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr); }
  ~Statement() { sqlite3_finalize(stmt_); }
  sqlite3_stmt* get() const { return stmt_; }
  void Text(int i, const std::string& s) { sqlite3_bind_text(stmt_, i, s.data(), int(s.size()), SQLITE_TRANSIENT); }
  void Int(int i, int64_t v) { sqlite3_bind_int64(stmt_, i, v); }

 private:
  sqlite3_stmt* stmt_ = nullptr;
};

std::string Column(sqlite3_stmt* s, int i) {
  const unsigned char* t = sqlite3_column_text(s, i);
  return t == nullptr ? std::string() : std::string(reinterpret_cast<const char*>(t), sqlite3_column_bytes(s, i));
}

}  // namespace

absl::StatusOr<std::unique_ptr<JournalStore>> JournalStore::Open(const std::string& path) {
  // Created 0600: events name hosts and jobs.
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("journal file ", path, " cannot be opened for writing; give a writable path (--journal-file)"));
  }
  ::close(fd);
  sqlite3* db = nullptr;
  const int rc = sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX, nullptr);
  std::unique_ptr<JournalStore> store(new JournalStore(db, path));
  auto fail = [&](const char* what) {
    return absl::InvalidArgumentError(absl::StrCat("journal file ", path, ": ", what, " (",
                                                   db ? sqlite3_errmsg(db) : sqlite3_errstr(rc),
                                                   "); move it away or give another --journal-file"));
  };
  if (rc != SQLITE_OK) return fail("cannot be opened as SQLite");
  sqlite3_busy_timeout(db, 2000);
  char* err = nullptr;
  if (sqlite3_exec(db, "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;", nullptr, nullptr, &err) != SQLITE_OK ||
      sqlite3_exec(db, kSchema, nullptr, nullptr, &err) != SQLITE_OK) {
    sqlite3_free(err);
    return fail("is not a shardcoord journal");
  }
  Statement probe(db, "SELECT id, unix_ms, severity, kind, job_id, rank, grp, message FROM shardcoord_events LIMIT 1");
  if (probe.get() == nullptr) return fail("has a shardcoord_events table of another shape");
  // A damaged file (a torn page, bytes overwritten) is refused now rather than found page by
  // page later, when a query or an append reaches it.
  {
    Statement check(db, "PRAGMA quick_check(1)");
    const std::string verdict =
        check.get() != nullptr && sqlite3_step(check.get()) == SQLITE_ROW ? Column(check.get(), 0) : "no answer";
    if (verdict != "ok") {
      return absl::InvalidArgumentError(absl::StrCat("journal file ", path, " is damaged (SQLite quick_check: ",
                                                     verdict.substr(0, 200),
                                                     "); move it away or give another --journal-file"));
    }
  }
  // Ids continue from the newest; one near the top of int64 (a file written by something else)
  // would leave no room for new events, which would then be hidden or refused.
  if (const uint64_t max_id = store->MaxId(); max_id > kMaxEventId) {
    return absl::InvalidArgumentError(absl::StrCat(
        "journal file ", path, ": its newest event id ", max_id, " is past 2^62, leaving no room for new ids (a file "
        "written by something else?); move it away or give another --journal-file"));
  }
  return store;
}

JournalStore::~JournalStore() { sqlite3_close_v2(db_); }

absl::Status JournalStore::Append(const std::vector<v1::Event>& events) {
  sqlite3_exec(db_, "BEGIN", nullptr, nullptr, nullptr);
  Statement insert(db_,
                   "INSERT OR REPLACE INTO shardcoord_events (id, unix_ms, severity, kind, job_id, rank, grp, message)"
                   " VALUES (?, ?, ?, ?, ?, ?, ?, ?)");
  for (const auto& e : events) {
    sqlite3_reset(insert.get());
    insert.Int(1, static_cast<int64_t>(e.id()));
    insert.Int(2, e.unix_ms());
    insert.Text(3, e.severity());
    insert.Text(4, e.kind());
    insert.Text(5, e.job_id());
    insert.Int(6, e.rank());
    insert.Int(7, e.group());
    insert.Text(8, e.message());
    if (sqlite3_step(insert.get()) != SQLITE_DONE) {
      const std::string why = sqlite3_errmsg(db_);
      sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
      return absl::UnavailableError(absl::StrCat("journal file ", path_, ": cannot append (", why, ")"));
    }
  }
  if (sqlite3_exec(db_, "COMMIT", nullptr, nullptr, nullptr) != SQLITE_OK) {
    const std::string why = sqlite3_errmsg(db_);
    sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
    return absl::UnavailableError(absl::StrCat("journal file ", path_, ": cannot commit (", why, ")"));
  }
  return absl::OkStatus();
}

std::vector<v1::Event> JournalStore::Query(const EventFilter& f) const {
  // Newest first without a cursor (then reversed), oldest first after one.
  const std::string sql = absl::StrCat(
      "SELECT id, unix_ms, severity, kind, job_id, rank, grp, message FROM shardcoord_events"
      " WHERE (?1 = '' OR job_id = ?1) AND (?2 = '' OR kind = ?2) AND unix_ms >= ?3 AND id > ?4 ORDER BY id ",
      f.after_id == 0 ? "DESC" : "ASC", " LIMIT ?5");
  Statement q(db_, sql.c_str());
  q.Text(1, f.job_id);
  q.Text(2, f.kind);
  q.Int(3, f.since_unix_ms);
  q.Int(4, static_cast<int64_t>(f.after_id));
  q.Int(5, std::max(0, f.limit));
  std::vector<v1::Event> out;
  while (q.get() != nullptr && sqlite3_step(q.get()) == SQLITE_ROW) {
    v1::Event e;
    e.set_id(static_cast<uint64_t>(sqlite3_column_int64(q.get(), 0)));
    e.set_unix_ms(sqlite3_column_int64(q.get(), 1));
    e.set_severity(Column(q.get(), 2));
    e.set_kind(Column(q.get(), 3));
    e.set_job_id(Column(q.get(), 4));
    e.set_rank(sqlite3_column_int(q.get(), 5));
    e.set_group(sqlite3_column_int(q.get(), 6));
    e.set_message(Column(q.get(), 7));
    out.push_back(std::move(e));
  }
  if (f.after_id == 0) std::reverse(out.begin(), out.end());
  return out;
}

uint64_t JournalStore::MaxId() const {
  Statement q(db_, "SELECT COALESCE(MAX(id), 0) FROM shardcoord_events");
  return q.get() != nullptr && sqlite3_step(q.get()) == SQLITE_ROW ? sqlite3_column_int64(q.get(), 0) : 0;
}

int64_t JournalStore::Prune(absl::Time now, absl::Duration retention, int64_t max_events) {
  Statement by_age(db_, "DELETE FROM shardcoord_events WHERE unix_ms < ?");
  by_age.Int(1, absl::ToUnixMillis(now - retention));
  sqlite3_step(by_age.get());
  int64_t removed = sqlite3_changes(db_);
  Statement by_count(db_, "DELETE FROM shardcoord_events WHERE id <= (SELECT MAX(id) FROM shardcoord_events) - ?");
  by_count.Int(1, max_events);
  sqlite3_step(by_count.get());
  return removed + sqlite3_changes(db_);
}

}  // namespace shardcoord::coordinator
