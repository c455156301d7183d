#include "shardcoord/plan_check.h"

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

std::string ControlCharacterIn(const std::string& name) {
  for (size_t i = 0; i < name.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(name[i]);
    if (c < 0x20 || c == 0x7f) {
      static const char kHex[] = "0123456789abcdef";
      return std::string("byte ") + std::to_string(i) + " is the control character 0x" + kHex[c >> 4] + kHex[c & 15];
    }
  }
  return "";
}

std::string Printable(const std::string& text, size_t max_bytes) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (i == max_bytes) return out + "...";
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
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
  return "";
}

}  // namespace shardcoord
