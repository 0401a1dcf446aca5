"""The per-step message from rank 0 to the workers: what a forward pass needs, as integers.

A fixed header of int64 (command, tokens, sequences, block-table width, decodes), then, for a
step, one int64 tensor holding input ids, positions, KV slots, query start offsets, sequence
lengths and the block table, back to back. Two broadcasts per step and no pickle: the worker
knows every size from the header, and nothing on the wire can run code. Workers rebuild the
same `AttentionMetadata` rank 0's model runner built, so every rank's attention reads and writes
the same KV slots of its own heads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fw.layers.attention import AttentionMetadata

STEP, STOP = 1, 2
HEADER_SIZE = 5


def header(command: int, tokens: int = 0, seqs: int = 0, width: int = 0, decodes: int = 0) -> torch.Tensor:
    return torch.tensor([command, tokens, seqs, width, decodes], dtype=torch.long)


def pack(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of one step, on the CPU."""
    seqs, width = meta.block_tables.shape
    payload = torch.cat([input_ids, positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens_tensor,
                         meta.block_tables.reshape(-1)]).to("cpu", torch.long)
    return header(STEP, input_ids.shape[0], seqs, width, meta.num_decodes), payload


def payload_size(head: list[int]) -> int:
    _, tokens, seqs, width, _ = head
    return 3 * tokens + (seqs + 1) + seqs + seqs * width


@dataclass
class Step:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


def unpack(head: list[int], payload: torch.Tensor, page_size: int, device: torch.device) -> Step:
    """The step rank 0 packed, with its tensors on `device`."""
    _, tokens, seqs, width, decodes = head
    starts_host = payload[3 * tokens:3 * tokens + seqs + 1]
    lens_host = payload[3 * tokens + seqs + 1:3 * tokens + 2 * seqs + 1]
    on_device = payload.to(device)
    cut = [tokens, tokens, tokens, seqs + 1, seqs, seqs * width]
    ids, pos, slots, starts, lens, tables = on_device.split(cut)
    meta = AttentionMetadata(
        num_decodes=decodes,
        query_lens=starts_host.diff().tolist(),
        seq_lens=lens_host.tolist(),
        query_start_loc=starts,
        seq_lens_tensor=lens,
        block_tables=tables.view(seqs, width),
        slot_mapping=slots,
        page_size=page_size,
    )
    return Step(ids, pos, meta)
