#include "shardcoord/plan_check.h"

#include <cstdio>

#include <algorithm>

namespace shardcoord {

std::string NamesForMessage(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < std::min(names.size(), kNamesInMessages); ++i) {
    if (i > 0) out += ", ";
    out += Printable(names[i]);
  }
  if (names.size() > kNamesInMessages) out += ", ... (" + std::to_string(names.size() - kNamesInMessages) + " more)";
  return out;
}

namespace {
bool IsControl(uint32_t cp);
size_t Utf8Length(const std::string& text, size_t i, uint32_t* code_point);
}  // namespace

std::string ControlCharacterIn(const std::string& name) {
  // C0 and C1 controls, DEL, bidi overrides and isolates (U+202E reverses what follows on an
  // operator's page or terminal), and bytes that are no UTF-8.
  for (size_t i = 0; i < name.size();) {
    uint32_t cp = 0;
    const size_t n = Utf8Length(name, i, &cp);
    if (n == 0) return "byte " + std::to_string(i) + " is not valid UTF-8";
    if (IsControl(cp)) {
      char shown[16];
      std::snprintf(shown, sizeof shown, cp <= 0x7f ? "0x%02x" : "U+%04X", static_cast<unsigned>(cp));
      return "byte " + std::to_string(i) + " is the control character " + shown;
    }
    i += n;
  }
  return "";
}

namespace {

// The length of the well-formed UTF-8 sequence at text[i] (1..4), or 0 when it is not one
// (a stray continuation byte, an overlong form, a surrogate, past U+10FFFF, or cut short).
size_t Utf8Length(const std::string& text, size_t i, uint32_t* code_point) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char c = byte(i);
  size_t n;
  uint32_t cp, min;
  if (c < 0x80) {
    *code_point = c;
    return 1;
  } else if ((c & 0xe0) == 0xc0) {
    n = 2, cp = c & 0x1f, min = 0x80;
  } else if ((c & 0xf0) == 0xe0) {
    n = 3, cp = c & 0x0f, min = 0x800;
  } else if ((c & 0xf8) == 0xf0) {
    n = 4, cp = c & 0x07, min = 0x10000;
  } else {
    return 0;
  }
  if (i + n > text.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (byte(i + k) & 0x3f);
  }
  if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  *code_point = cp;
  return n;
}

// Characters that change how a terminal or a page shows what follows: C0 and C1 controls,
// DEL, and the bidirectional embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069).
bool IsControl(uint32_t cp) {
  return cp < 0x20 || (cp >= 0x7f && cp <= 0x9f) || (cp >= 0x202a && cp <= 0x202e) ||
         (cp >= 0x2066 && cp <= 0x2069);
}

}  // namespace

std::string Printable(const std::string& text, size_t max_bytes) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < text.size();) {
    uint32_t cp = 0;
    size_t n = Utf8Length(text, i, &cp);
    std::string piece;
    if (n == 0 || IsControl(cp)) {
      // Escaped byte by byte: an invalid sequence or a control is shown, never passed on.
      if (n == 0) n = 1;
      for (size_t k = 0; k < n; ++k) {
        const unsigned char c = static_cast<unsigned char>(text[i + k]);
        piece += "\\x";
        piece += kHex[c >> 4];
        piece += kHex[c & 15];
      }
    } else {
      piece = text.substr(i, n);
    }
    if (out.size() + piece.size() > max_bytes) return out + "...";  // Cut between characters.
    out += piece;
    i += n;
  }
  return out;
}

std::string CheckPlanKey(const MicrobatchKey& key) {
  if (key.step < 0 || key.microbatch < 0) return "step and microbatch must be >= 0";
  return "";
}

std::string CheckPlanCall(const std::string& module, int64_t calls, bool known,
                          const std::vector<std::string>& registered) {
  if (!known) {
    return "names unknown module '" + Printable(module) + "'; the registered controlled modules are [" +
           NamesForMessage(registered) + "]";
  }
  if (calls < 0) {
    return "module '" + module + "' has " + std::to_string(calls) + " calls; calls must be >= 0";
  }
  if (calls > kMaxCallsPerModule) {
    return "module '" + module + "' has " + std::to_string(calls) + " calls in one microbatch; at most " +
           std::to_string(kMaxCallsPerModule) + " are allowed (count the module's forward calls, not its inputs)";
  }
  return "";
}

}  // namespace shardcoord
