#include "coordinator/core/decision_wire.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"

namespace shardcoord::coordinator {
namespace {

using google::protobuf::io::CodedOutputStream;

// A field's tag (protobuf's encoding: number << 3 | wire type).
constexpr uint32_t kVarint = 0;
constexpr uint32_t kLengthDelimited = 2;
constexpr uint32_t Tag(int field, uint32_t wire_type) { return static_cast<uint32_t>(field) << 3 | wire_type; }
constexpr uint32_t kEntryTag = Tag(v1::DecisionBatch::kDecisionsFieldNumber, kLengthDelimited);
constexpr uint32_t kBatchTag = Tag(v1::CoordinatorMessage::kDecisionsFieldNumber, kLengthDelimited);
constexpr uint32_t kIncarnationTag = Tag(v1::CoordinatorMessage::kIncarnationFieldNumber, kVarint);

size_t EntriesSize(absl::Span<const EncodedDecision> batch) {
  size_t n = 0;
  for (const EncodedDecision& d : batch) n += d->size();
  return n;
}

}  // namespace

EncodedDecision EncodeDecision(const v1::MicrobatchDecision& decision) {
  const size_t body = decision.ByteSizeLong();
  std::string out(CodedOutputStream::VarintSize32(kEntryTag) + CodedOutputStream::VarintSize64(body) + body, '\0');
  uint8_t* p = reinterpret_cast<uint8_t*>(out.data());
  p = CodedOutputStream::WriteVarint32ToArray(kEntryTag, p);
  p = CodedOutputStream::WriteVarint64ToArray(body, p);
  decision.SerializeWithCachedSizesToArray(p);
  return std::make_shared<const std::string>(std::move(out));
}

// Fields in number order, as protobuf writes them: the batch (2), then the incarnation (10),
// which proto3 leaves out when it is 0.
size_t DecisionsMessageSize(absl::Span<const EncodedDecision> batch, uint64_t incarnation) {
  const size_t entries = EntriesSize(batch);
  size_t n = CodedOutputStream::VarintSize32(kBatchTag) + CodedOutputStream::VarintSize64(entries) + entries;
  if (incarnation != 0) n += CodedOutputStream::VarintSize32(kIncarnationTag) + CodedOutputStream::VarintSize64(incarnation);
  return n;
}

void WriteDecisionsMessage(absl::Span<const EncodedDecision> batch, uint64_t incarnation, uint8_t* out) {
  out = CodedOutputStream::WriteVarint32ToArray(kBatchTag, out);
  out = CodedOutputStream::WriteVarint64ToArray(EntriesSize(batch), out);
  for (const EncodedDecision& d : batch) {
    out = std::copy(d->begin(), d->end(), out);
  }
  if (incarnation != 0) {
    out = CodedOutputStream::WriteVarint32ToArray(kIncarnationTag, out);
    CodedOutputStream::WriteVarint64ToArray(incarnation, out);
  }
}

absl::StatusOr<v1::CoordinatorMessage> DecodeDecisions(absl::Span<const EncodedDecision> batch) {
  std::string entries;
  entries.reserve(EntriesSize(batch));
  for (const EncodedDecision& d : batch) entries += *d;
  v1::CoordinatorMessage msg;
  if (!msg.mutable_decisions()->ParseFromString(entries)) {
    return absl::InternalError(absl::StrCat("the ", batch.size(), " encoded decisions (", entries.size(),
                                            " bytes) do not parse as a DecisionBatch: a bug in decision_wire.cc"));
  }
  return msg;
}

}  // namespace shardcoord::coordinator
