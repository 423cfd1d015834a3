"""Handoff volume on the full K3 shape (meta device, nothing allocated): per decode rank at TP8,
54,263,808 B of KDA state (spec section 8) plus 1,907,712 B of conv states (W-1 columns) plus
the rank's share of the prompt's MLA latent (27,648 B per token, 1/8 of the tokens with DCP8)."""

import pytest
import torch

from k3batch.model import get_flavor
from k3batch.parallel.handoff import handoff_bytes, reshard_request
from k3batch.parallel.layout import ParallelLayout


@pytest.mark.parametrize("dcp,tokens_on_rank0", [(1, 1000), (8, 125)])
def test_k3_tp8_handoff_bytes_per_rank(dcp, tokens_on_rank0):
    cfg = get_flavor("k3")
    H, K, W, L = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size, 1000
    meta = torch.device("meta")
    full = {
        "kda_state": {i: torch.empty(H, K, K, device=meta) for i in cfg.kda_layer_ids},
        "kda_conv": {
            i: torch.empty(3, H * K, W - 1, dtype=torch.bfloat16, device=meta)
            for i in cfg.kda_layer_ids
        },
        "mla_latent": {
            i: torch.empty(L, cfg.mla_latent_size, dtype=torch.bfloat16, device=meta)
            for i in cfg.mla_layer_ids
        },
    }
    pieces = reshard_request(full, cfg, ParallelLayout(tp_size=8, dcp_size=dcp), 0)
    assert handoff_bytes(pieces) == 54_263_808 + 1_907_712 + tokens_on_rank0 * 27_648
