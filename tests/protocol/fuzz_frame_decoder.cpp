// libFuzzer entry: the input is a byte stream cut into reads of varying size
// (the first byte picks the read size); every frame that comes out is decoded
// by its command's payload decoder, and recoverable errors are answered with
// an error frame, as a real receiver would.
#include <cstddef>
#include <cstdint>

#include "protocol/messages.h"

using namespace moe::protocol;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t read_size = 1 + data[0] % 64;
  FrameDecoder decoder(size_t{1} << 20);
  for (size_t at = 1; at < size && !decoder.failed(); at += read_size) {
    decoder.feed(std::span<const uint8_t>(data + at, std::min(read_size, size - at)));
    for (DecodeEvent ev = decoder.next(); ev.status != DecodeStatus::need_more;
         ev = decoder.next()) {
      if (ev.status == DecodeStatus::error) {
        (void)make_error_frame(ev.error);
        continue;
      }
      auto msg = decode_message(ev.frame);
      if (!msg)
        (void)make_error_frame(ev.frame.request_id, ev.frame.command, ErrorCode::malformed_payload,
                               msg.error());
    }
  }
  return 0;
}
