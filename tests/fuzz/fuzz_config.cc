// Fuzzes config.json parsing and validation (common/config.h): ParseModelConfig on the input. A config that
// validates must write back (ModelConfigToJson) to a text that validates again and writes the same text,
// and its derived tables (rope frequencies, layer counts) must be computable.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto config = numoe::ParseModelConfig(text, "config.json");
  if (!config.ok()) return 0;
  const std::string written = numoe::ModelConfigToJson(*config);
  auto again = numoe::ParseModelConfig(written, "written config.json");
  if (!again.ok()) {
    std::fprintf(stderr, "a valid config wrote an invalid one: %s\n%s\n", again.status().ToString().c_str(),
                 written.c_str());
    std::abort();
  }
  if (numoe::ModelConfigToJson(*again) != written) {
    std::fprintf(stderr, "config.json does not round-trip:\n%s\n", written.c_str());
    std::abort();
  }
  const numoe::ModelConfig& c = *config;
  (void)numoe::RopeInvFreq(c.rope_main, c.rope_dim);
  (void)numoe::RopeInvFreq(c.rope_compress, c.rope_dim);
  int64_t layers = 0;
  for (auto t : {numoe::AttnType::kSliding, numoe::AttnType::kCSA, numoe::AttnType::kHCA}) layers += c.NumLayersOf(t);
  if (layers != c.num_hidden_layers) std::abort();
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) (void)c.CompressRate(l);
  (void)c.DefaultMtpStages();
  return 0;
}
