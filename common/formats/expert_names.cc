#include "common/formats/expert_names.h"

namespace lorastream {

int ExpertProjectionOf(const std::string& name, int64_t* expert) {
  std::string rest;
  for (const char* prefix : {"mlp.experts.", "block_sparse_moe.experts."})
    if (name.rfind(prefix, 0) == 0) rest = name.substr(std::string(prefix).size());
  const size_t dot = rest.find('.');
  if (rest.empty() || dot == 0 || dot == std::string::npos || dot > 6) return -1;
  for (size_t i = 0; i < dot; ++i)
    if (rest[i] < '0' || rest[i] > '9') return -1;
  if (dot > 1 && rest[0] == '0') return -1;
  *expert = std::stoll(rest.substr(0, dot));
  const std::string proj = rest.substr(dot + 1);
  const bool mixtral = name[0] == 'b';
  static const char* kQwen[] = {"gate_proj.weight", "up_proj.weight", "down_proj.weight"};
  static const char* kMixtral[] = {"w1.weight", "w3.weight", "w2.weight"};
  for (int p = 0; p < 3; ++p)
    if (proj == (mixtral ? kMixtral : kQwen)[p]) return p;
  return -1;
}

}  // namespace lorastream
