// The autograd graph behind a tensor, for tests that tell how a model ran: how many of its
// nodes have a name containing a given part ("CheckpointedUnit", "TapedUnitUse").
#pragma once

#include <set>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

namespace lorastream::testing {

inline int CountGraphNodes(const at::Tensor& out, const std::string& name_part) {
  std::vector<torch::autograd::Node*> todo;
  std::set<torch::autograd::Node*> seen;
  if (const auto& fn = out.grad_fn()) todo.push_back(fn.get());
  int count = 0;
  while (!todo.empty()) {
    torch::autograd::Node* n = todo.back();
    todo.pop_back();
    if (!seen.insert(n).second) continue;
    if (n->name().find(name_part) != std::string::npos) ++count;
    for (const auto& e : n->next_edges())
      if (e.function) todo.push_back(e.function.get());
  }
  return count;
}

}  // namespace lorastream::testing
