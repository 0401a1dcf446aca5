"""fw.model.fast_attributes: a loaded model's submodules and parameters as plain attributes, the same objects
nn.Module.__getattr__ would return, and torch's own reassignments still seen."""

from __future__ import annotations

import torch
from torch import nn

from conftest import make_llm
from fw import SamplingParams
from fw.model import fast_attributes


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.register_buffer("table", torch.arange(4.0))
        self.plain = "kept"


def _lookups(model: nn.Module) -> dict[str, object]:
    """Every (module path, name) -> what attribute lookup returns for its submodules, parameters and buffers."""
    out = {}
    for path, module in model.named_modules():
        for name in [*module._modules, *module._parameters, *module._buffers]:
            out[f"{path}.{name}"] = getattr(module, name)
    return out


def test_freeze_aliases_the_same_objects_and_thaw_undoes_it():
    model = nn.Sequential(Block(), Block())
    before, state = _lookups(model), {k: v.clone() for k, v in model.state_dict().items()}
    fast_attributes.freeze(model)
    assert fast_attributes.is_frozen(model)
    block = model[0]
    assert block.__dict__["proj"] is block._modules["proj"] and block.proj.__dict__["weight"] is block.proj._parameters["weight"]
    assert "table" not in block.__dict__ and block.plain == "kept"  # buffers and plain attributes left alone
    after = _lookups(model)
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())  # state_dict unaffected
    fast_attributes.thaw(model)
    assert "proj" not in block.__dict__ and not fast_attributes.is_frozen(model)
    assert all(_lookups(model)[k] is before[k] for k in before)


def test_a_parameter_wins_over_a_submodule_of_its_name():
    """bitsandbytes keeps a state holder under `_modules["weight"]` beside the `weight` parameter:
    __getattr__ returns the parameter, and so must the alias."""
    layer = nn.Linear(4, 4)
    holder = nn.Module()
    layer._modules["weight"] = holder
    fast_attributes.freeze(layer)
    assert layer.weight is layer._parameters["weight"]


def test_reassigning_through_setattr_after_freeze_is_seen():
    block = Block()
    fast_attributes.freeze(block)
    new_proj, new_weight = nn.Linear(4, 4), nn.Parameter(torch.zeros(4))
    block.proj = new_proj
    block.norm.weight = new_weight
    assert block.proj is new_proj and block.norm.weight is new_weight
    x = torch.ones(1, 4)
    assert torch.equal(block.proj(x), new_proj(x))


def test_a_loaded_model_is_frozen_and_generates_as_before(gqa_dir):
    llm = make_llm(gqa_dir)
    model = llm.engine.loaded.model
    assert fast_attributes.is_frozen(model)
    for path, param in model.named_parameters():
        owner, _, name = path.rpartition(".")
        assert model.get_submodule(owner).__dict__[name] is param  # a plain attribute, the registered object
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = llm.generate(["Hello world"], greedy)[0].outputs[0].token_ids
    fast_attributes.thaw(model)
    assert llm.generate(["Hello world"], greedy)[0].outputs[0].token_ids == first
