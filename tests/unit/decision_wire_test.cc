// A decision encoded once for its group (decision_wire.h) must be, byte for byte, what each
// member's own protobuf would have been on the wire.
#include "coordinator/core/decision_wire.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace shardcoord::coordinator {
namespace {

v1::MicrobatchDecision MakeDecision(int group, int64_t step, int modules) {
  v1::MicrobatchDecision d;
  d.set_group(group);
  d.mutable_key()->set_step(step);
  d.mutable_key()->set_microbatch(3);
  d.set_seq(static_cast<uint64_t>(step) * 7 + 300);  // Multi-byte varints.
  d.set_epoch(2);
  for (int i = 0; i < modules; ++i) {
    v1::ModuleDecision* m = d.add_modules();
    m->set_module("model.vision_tower.encoder.layers." + std::to_string(i));
    m->set_decision(i % 2 == 0 ? v1::DECISION_PER_LAYER : v1::DECISION_PADDED);
    m->set_calls(i % 2 == 0 ? 0 : 2);
  }
  d.set_digest(0xfedcba9876543210ULL);
  d.set_decided_unix_ms(1'780'000'000'000);
  d.set_seal(std::string("\x00\xff\x10 sixteen bytes!", 16));
  return d;
}

// What the daemon wrote before: each member's CoordinatorMessage, serialized by protobuf.
std::string Typed(const std::vector<v1::MicrobatchDecision>& ds, uint64_t incarnation) {
  v1::CoordinatorMessage msg;
  msg.mutable_decisions();
  for (const auto& d : ds) *msg.mutable_decisions()->add_decisions() = d;
  msg.set_incarnation(incarnation);
  return msg.SerializeAsString();
}

std::string Encoded(const std::vector<v1::MicrobatchDecision>& ds, uint64_t incarnation) {
  std::vector<EncodedDecision> batch;
  for (const auto& d : ds) batch.push_back(EncodeDecision(d));
  std::string out(DecisionsMessageSize(batch, incarnation), '\x7f');
  WriteDecisionsMessage(batch, incarnation, reinterpret_cast<uint8_t*>(out.data()));
  return out;
}

TEST(DecisionWireTest, TheBytesAreWhatProtobufWritesForTheSameMessage) {
  // One module (a short entry), 40 (a two-byte length), 800 (three bytes: over 16 KiB), together.
  const std::vector<v1::MicrobatchDecision> ds = {MakeDecision(0, 0, 1), MakeDecision(5, 123456789, 40),
                                                  MakeDecision(511, 9, 800)};
  ASSERT_GT(ds[2].ByteSizeLong(), 16384u);
  for (const uint64_t incarnation : {uint64_t{0}, uint64_t{1}, uint64_t{0xdeadbeefcafef00dULL}}) {
    for (size_t n = 1; n <= ds.size(); ++n) {
      const std::vector<v1::MicrobatchDecision> some(ds.begin(), ds.begin() + static_cast<long>(n));
      EXPECT_EQ(Encoded(some, incarnation), Typed(some, incarnation)) << n << " decisions, incarnation " << incarnation;
    }
  }
  EXPECT_EQ(Encoded({}, 7), Typed({}, 7)) << "an empty batch";
}

TEST(DecisionWireTest, AnEncodedDecisionParsesBackToItself) {
  const std::vector<v1::MicrobatchDecision> ds = {MakeDecision(1, 4, 3), MakeDecision(1, 5, 0)};
  std::vector<EncodedDecision> batch = {EncodeDecision(ds[0]), EncodeDecision(ds[1])};
  absl::StatusOr<v1::CoordinatorMessage> msg = DecodeDecisions(batch);
  ASSERT_TRUE(msg.ok()) << msg.status();
  ASSERT_EQ(msg->decisions().decisions_size(), 2);
  EXPECT_EQ(msg->decisions().decisions(0).SerializeAsString(), ds[0].SerializeAsString());
  EXPECT_EQ(msg->decisions().decisions(1).SerializeAsString(), ds[1].SerializeAsString());

  // Bytes that are not an entry are an error, not a message with less in it.
  batch.push_back(std::make_shared<const std::string>("\x0a\x05" "ab"));
  EXPECT_EQ(DecodeDecisions(batch).status().code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace shardcoord::coordinator
