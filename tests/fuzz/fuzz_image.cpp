// Fuzz target: the image decoder of the image-folder converter (data::decode_image: JPEG through
// libjpeg-turbo, PNG through libpng, told apart by their first bytes), then the resize and centre
// crop every decoded image goes through. The input is the image file; its length picks the channels
// (odd: grey) and whether a JPEG may be decoded at a reduced scale (a multiple of 4: no).
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/data/image_folder.h"
#include "fuzz_util.h"

using namespace dtrain;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::fs::path file = fuzz::fresh_scratch() / "image";
  fuzz::write_file(file, {data, size});
  const int channels = size % 2 ? 1 : 3;
  const int size_out = 8;
  try {
    const data::DecodedImage img = data::decode_image(file.string(), channels, size % 4 == 0 ? 0 : size_out);
    if (img.channels != channels || img.height < 1 || img.width < 1 ||
        img.pixels.size() != static_cast<size_t>(img.height) * img.width * channels)
      fuzz::fail("decode_image gave " + std::to_string(img.height) + " x " + std::to_string(img.width) + " x " +
                 std::to_string(img.channels) + " in " + std::to_string(img.pixels.size()) + " bytes");
    std::vector<uint8_t> chw(static_cast<size_t>(channels) * size_out * size_out);
    data::resize_and_center_crop(img, size_out, chw.data());
  } catch (const InputError& e) {
    fuzz::rejected(e);
  }
  return 0;
}
