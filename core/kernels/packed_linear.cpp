// fw_packed::linear: a dense linear layer whose weight is in oneDNN's packed layout, named by its index
// in a table of registered weights instead of passed as a tensor.
//
// Why: fw packs CPU linear weights for oneDNN at load (fw.layers.dense); a packed weight is an opaque
// tensor that torch.compile cannot trace (fake tensors cannot hold it), and inductor only lowers
// mkldnn._linear_pointwise for weights frozen into the graph, which disables its caches. A graph that
// calls this op with an index keeps the packed weights (one copy, shared by every bucket's graph) and
// stays cacheable. A Python custom op would do the same at ~9 us of dispatch per call (4 linears x 30
// layers per step); this one costs what the direct call costs.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <deque>
#include <mutex>
#include <optional>

namespace {

struct Entry {
  at::Tensor weight;
  std::optional<at::Tensor> bias;
};

// One table per model: a graph holds indices into "the current table", which the caller selects for
// its thread before running it (fw.compile.ops.step_context), so two models of the same shapes share
// one compiled graph, and the compile cache, whatever order they were loaded in.
std::mutex g_mutex;
std::deque<std::vector<Entry>> g_tables;  // a deque: adding a table never moves another one
std::deque<bool> g_live;
thread_local int64_t t_table = -1;

int64_t new_table() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_tables.emplace_back();
  g_live.push_back(true);
  return static_cast<int64_t>(g_tables.size()) - 1;
}

void check_table(int64_t table) {
  TORCH_CHECK(table >= 0 && table < static_cast<int64_t>(g_tables.size()) && g_live[table],
              "fw_packed: weight table ", table, " does not exist (released?)");
}

int64_t register_weight(int64_t table, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  std::lock_guard<std::mutex> lock(g_mutex);
  check_table(table);
  g_tables[table].push_back(Entry{weight, bias});
  return static_cast<int64_t>(g_tables[table].size()) - 1;
}

void release_table(int64_t table) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (table >= 0 && table < static_cast<int64_t>(g_tables.size())) {
    g_tables[table].clear();
    g_live[table] = false;
  }
}

int64_t select_table(int64_t table) {
  int64_t previous = t_table;
  t_table = table;
  return previous;
}

at::Tensor linear(const at::Tensor& x, int64_t index, int64_t out_features) {
  using Fn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                        c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>);
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<Fn>();
  const Entry* entry;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    check_table(t_table);
    const auto& table = g_tables[t_table];
    TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(table.size()), "fw_packed::linear: no weight ", index,
                " in table ", t_table);
    entry = &table[index];
  }
  TORCH_CHECK(entry->weight.size(0) == out_features, "fw_packed::linear: weight ", index, " has ",
              entry->weight.size(0), " outputs, the graph expects ", out_features);
  return op.call(x, entry->weight, entry->bias, "none", c10::List<std::optional<at::Scalar>>(), "");
}

}  // namespace

TORCH_LIBRARY(fw_packed, m) {
  m.def("new_table() -> int");
  m.def("register_weight(int table, Tensor weight, Tensor? bias) -> int");
  m.def("release_table(int table) -> ()");
  m.def("select_table(int table) -> int");
  m.def("linear(Tensor x, int index, int out_features) -> Tensor");
  m.impl("new_table", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(new_table));
  m.impl("register_weight", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(register_weight));
  m.impl("release_table", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(release_table));
  m.impl("select_table", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(select_table));
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
}
