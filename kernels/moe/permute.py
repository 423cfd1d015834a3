"""Token slots sorted by expert, on the device (no host sync).

A token's k routed slots are the rows t k + j of the flat [T k] slot list. `sort_slots` orders
them by local expert (stable, so by slot within an expert) and returns what the grouped GEMMs
and the combine need. Slots routed to experts outside [first_expert, first_expert + E) (another
expert-parallel rank's) sort last, after `offs[-1]`: the grouped GEMMs leave those rows
unwritten and the combine skips them.
Shape legend: T tokens, k top-k, E local experts, M = T k slots.
"""

from typing import NamedTuple

import torch


class SlotOrder(NamedTuple):
    token_M: torch.Tensor  # [M] int64: the token of each sorted slot (rows to gather)
    offs_E: torch.Tensor  # [E] int32: end row of each expert's group (cumulative counts)
    slot_pos_Tk: torch.Tensor  # [T, k] int64: row of slot (t, j) in the sorted order
    valid_Tk: torch.Tensor  # [T, k] bool: the slot's expert is held here


def sort_slots(ids_Tk: torch.Tensor, num_experts: int, first_expert: int = 0) -> SlotOrder:
    """Sort the token slots of global expert ids [T, k] by local expert (see module doc)."""
    T, k = ids_Tk.shape
    local_Tk = ids_Tk.long() - first_expert
    valid_Tk = (local_Tk >= 0) & (local_Tk < num_experts)
    key_M = torch.where(valid_Tk, local_Tk, num_experts).reshape(-1)  # others: group E
    order_M = torch.argsort(key_M, stable=True)
    # Group ends by binary search in the sorted keys: bincount would read its max on the host.
    experts = torch.arange(num_experts, device=key_M.device)
    offs_E = torch.searchsorted(key_M[order_M], experts, right=True).to(torch.int32)
    rows = torch.arange(order_M.numel(), device=key_M.device)
    slot_pos = torch.empty_like(order_M).scatter_(0, order_M, rows)
    return SlotOrder(order_M // k, offs_E, slot_pos.view(T, k), valid_Tk)
