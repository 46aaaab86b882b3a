#pragma once
// SHA-256 (FIPS 180-4), for naming things after a secret without storing it:
// a session's Redis key carries a digest of the caller's API key.

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace moe::gw {

std::array<uint8_t, 32> sha256(std::string_view data);
// Lower-case hex of the digest.
std::string sha256_hex(std::string_view data);

}  // namespace moe::gw
