// A decode step's chain of op calls, replayed in C++ (fw.layers.step_program builds it from the layers).
//
// Why: on a small model a batch-1 step is mostly the Python between the kernels (frames, attribute reads,
// torch.ops' Python wrapper, ~75 us a layer against ~100 us of kernels); replaying the same calls through
// the dispatcher leaves a few microseconds a layer. A program is a list of instructions over registers:
// CALL an op (any registered op, arguments constants or registers, its returns into registers), NARROW a
// register's columns, VIEW it as [rows, dims...], RESHAPE it, EMPTY a [rows, cols] tensor like a register's.
// The rows of every view and new tensor are the step's own (a register's size(0)), so one program serves any
// batch.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

namespace {

enum class Kind { Call, Narrow, View, Reshape, Empty };

constexpr int64_t kEmptyList = -2;  // in `arg_regs`: the argument is an empty list

struct Instruction {
  Kind kind;
  std::optional<c10::OperatorHandle> op;   // Call
  std::vector<c10::IValue> constants;      // Call: the argument where `arg_regs` is -1
  std::vector<int64_t> arg_regs;           // Call: the register holding the argument, or -1
  std::vector<int64_t> outs;               // Call: the registers its returns go to; others: outs[0]
  int64_t src = -1;                        // Narrow, View, Empty: the register read
  int64_t start = 0, length = 0;           // Narrow: columns [start, start + length); Empty: length = cols
  std::vector<int64_t> shape;              // View: the dims after the rows; Reshape: the whole shape
  int64_t rows_of = -1;                    // View: the register whose size(0) is the rows (-1: src's own)
};

struct StepProgram : torch::CustomClassHolder {
  int64_t num_inputs;
  int64_t num_regs;
  std::vector<Instruction> code;

  explicit StepProgram(int64_t num_inputs) : num_inputs(num_inputs), num_regs(num_inputs) {}

  // `args[i]` is passed as is where `arg_regs[i]` is -1, an empty list where it is -2, else the register's
  // value; returns the first of the op's return registers (consecutive), or -1 for an op that returns nothing
  int64_t call(const std::string& name, std::vector<c10::IValue> args, std::vector<int64_t> arg_regs) {
    auto pos = name.find("::");
    TORCH_CHECK(pos != std::string::npos, "StepProgram.call: name the op as namespace::name, got ", name);
    auto dot = name.find('.', pos);
    std::string qualified = dot == std::string::npos ? name : name.substr(0, dot);
    std::string overload = dot == std::string::npos ? "" : name.substr(dot + 1);
    auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(qualified.c_str(), overload.c_str());
    const auto& schema = handle.schema();
    TORCH_CHECK(args.size() == arg_regs.size(), "StepProgram.call: ", args.size(), " arguments, ",
                arg_regs.size(), " register slots");
    TORCH_CHECK(args.size() == schema.arguments().size(), "StepProgram.call: ", name, " takes ",
                schema.arguments().size(), " arguments, got ", args.size());
    for (size_t i = 0; i < arg_regs.size(); ++i) {
      if (arg_regs[i] == kEmptyList) {  // Python cannot pass an empty list as Any: made here, typed as the op takes it
        auto list_type = schema.arguments()[i].type()->cast<c10::ListType>();
        TORCH_CHECK(list_type, "StepProgram.call: ", name, "'s argument ", i, " is not a list");
        args[i] = c10::impl::GenericList(list_type->getElementType());
        arg_regs[i] = -1;
      }
      if (arg_regs[i] != -1) check_reg(arg_regs[i]);
    }
    Instruction in{Kind::Call};
    in.op = handle;
    in.constants = std::move(args);
    in.arg_regs = std::move(arg_regs);
    int64_t first = schema.returns().empty() ? -1 : num_regs;
    for (size_t i = 0; i < schema.returns().size(); ++i) in.outs.push_back(num_regs++);
    code.push_back(std::move(in));
    return first;
  }

  int64_t narrow(int64_t src, int64_t start, int64_t length) {
    check_reg(src);
    Instruction in{Kind::Narrow};
    in.src = src, in.start = start, in.length = length, in.outs = {num_regs++};
    int64_t out = in.outs[0];
    code.push_back(std::move(in));
    return out;
  }

  // src.view(rows, shape...), the rows those of register `rows_of` (-1: src's own)
  int64_t view(int64_t src, std::vector<int64_t> shape, int64_t rows_of) {
    check_reg(src);
    if (rows_of != -1) check_reg(rows_of);
    Instruction in{Kind::View};
    in.src = src, in.shape = std::move(shape), in.rows_of = rows_of, in.outs = {num_regs++};
    int64_t out = in.outs[0];
    code.push_back(std::move(in));
    return out;
  }

  // src.reshape(shape): a view where the strides allow one, else a copy (as torch's reshape)
  int64_t reshape(int64_t src, std::vector<int64_t> shape) {
    check_reg(src);
    Instruction in{Kind::Reshape};
    in.src = src, in.shape = std::move(shape), in.outs = {num_regs++};
    int64_t out = in.outs[0];
    code.push_back(std::move(in));
    return out;
  }

  // a new [rows, cols] tensor with the register's dtype; cols < 0: the register's own shape
  int64_t empty(int64_t like, int64_t cols) {
    check_reg(like);
    Instruction in{Kind::Empty};
    in.src = like, in.length = cols, in.outs = {num_regs++};
    int64_t out = in.outs[0];
    code.push_back(std::move(in));
    return out;
  }

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs, const std::vector<int64_t>& results) const {
    TORCH_CHECK(static_cast<int64_t>(inputs.size()) == num_inputs, "StepProgram.run: ", num_inputs,
                " inputs expected, got ", inputs.size());
    std::vector<c10::IValue> regs(num_regs);
    for (size_t i = 0; i < inputs.size(); ++i) regs[i] = inputs[i];
    torch::jit::Stack stack;
    for (const auto& in : code) {
      switch (in.kind) {
        case Kind::Call: {
          stack.clear();
          for (size_t i = 0; i < in.arg_regs.size(); ++i)
            stack.push_back(in.arg_regs[i] < 0 ? in.constants[i] : regs[in.arg_regs[i]]);
          in.op->callBoxed(&stack);
          for (size_t i = 0; i < in.outs.size(); ++i) regs[in.outs[i]] = std::move(stack[i]);
          break;
        }
        case Kind::Narrow:
          regs[in.outs[0]] = regs[in.src].toTensor().narrow(1, in.start, in.length);
          break;
        case Kind::View: {
          const auto& t = regs[in.src].toTensor();
          std::vector<int64_t> shape{(in.rows_of < 0 ? t : regs[in.rows_of].toTensor()).size(0)};
          shape.insert(shape.end(), in.shape.begin(), in.shape.end());
          regs[in.outs[0]] = t.view(shape);
          break;
        }
        case Kind::Reshape:
          regs[in.outs[0]] = regs[in.src].toTensor().reshape(in.shape);
          break;
        case Kind::Empty: {
          const auto& t = regs[in.src].toTensor();
          regs[in.outs[0]] = in.length < 0 ? at::empty(t.sizes(), t.options())
                                           : at::empty({t.size(0), in.length}, t.options());
          break;
        }
      }
    }
    std::vector<at::Tensor> out;
    for (auto r : results) {
      check_reg(r);
      out.push_back(regs[r].toTensor());
    }
    return out;
  }

  int64_t instructions() const { return static_cast<int64_t>(code.size()); }

 private:
  void check_reg(int64_t r) const {
    TORCH_CHECK(r >= 0 && r < num_regs, "StepProgram: register ", r, " does not exist yet (", num_regs, " so far)");
  }
};

std::vector<at::Tensor> run_program(const c10::intrusive_ptr<StepProgram>& program, const std::vector<at::Tensor>& inputs,
                                    const std::vector<int64_t>& results) {
  return program->run(inputs, results);
}

}  // namespace

TORCH_LIBRARY(fw_step, m) {
  m.class_<StepProgram>("StepProgram")
      .def(torch::init<int64_t>())
      .def("call", &StepProgram::call)
      .def("narrow", &StepProgram::narrow)
      .def("view", &StepProgram::view)
      .def("reshape", &StepProgram::reshape)
      .def("empty", &StepProgram::empty)
      .def("instructions", &StepProgram::instructions);
  // an op rather than a method: torch.ops calls release the GIL while the step runs, as the kernels' calls do
  m.def("run(__torch__.torch.classes.fw_step.StepProgram program, Tensor[] inputs, int[] results) -> Tensor[]");
  m.impl("run", c10::DispatchKey::CPU, TORCH_FN(run_program));
}
