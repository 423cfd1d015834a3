"""The seed table (k3batch/sim/seed.py) from the recorded H100 calibration: the rows it can
predict are predicted, the others say which points are missing."""

from k3batch.sim.calibration import Calibration
from k3batch.sim.records import BENCH
from k3batch.sim.seed import dcp_capacity, seed_table


def test_dcp8_capacity_gain_is_the_blogs():
    from k3batch.parallel.plan import checkpoint_config

    cap = dcp_capacity(checkpoint_config("k3"), "gb300", 288 * 10**9)
    assert round(cap["gain"], 1) == 7.9 and cap["dcp"] > 12e6


def test_seed_table_predicts_what_the_table_holds_and_names_what_it_lacks():
    lines = seed_table(Calibration.load(BENCH / "calibration_h100.jsonl"), pd_seqs=(0,))
    text = "\n".join(lines)
    assert "gain 7.90x vs 7.9x" in text
    assert any(line.strip().startswith("PP8 ") and "tok/s of 8K prompts" in line for line in lines)
    assert "sequences decoding at once (2,808 x 8 GPUs / 18.7)" in text
    for row in ("PP8 / TEP8", "48 sessions", "PP8 -> TP8 decode"):
        i, line = next((i, x) for i, x in enumerate(lines) if row in x)
        if line.rstrip().endswith("N/A"):  # the table lacks its tp 8 points: it says which
            assert "no calibration points for part" in lines[i + 1], lines[i + 1]
        else:
            assert float(line.split()[-1]) > 0, line


def test_tep8_spends_more_of_its_prefill_in_all_reduces_across_two_nodes_than_on_nvlink():
    """The seed's "2x4 GB300" read two ways: 2 nodes of 4 (InfiniBand between) or 8 GPUs of
    one NVLink domain; PP8 sends one stream per stage, TEP8 all-reduces every layer."""
    from k3batch.parallel.plan import checkpoint_config
    from k3batch.sim.cluster import cluster_from, derated
    from k3batch.sim.seed import pp_prefill, tep_prefill

    config, ratios, shares = checkpoint_config("k3"), {}, {}
    for name in ("gb300x4x2", "gb300-nvl72"):
        cluster = cluster_from(name)
        cal = Calibration.load(BENCH / "calibration_h100.jsonl").on(derated(cluster.gpu))
        tep = tep_prefill(config, cal, cluster)
        ratios[name] = pp_prefill(config, cal, cluster, prompts=8)["tok_s"] / tep["tok_s"]
        shares[name] = tep["comm_share"]
    assert shares["gb300x4x2"] > 2 * shares["gb300-nvl72"]
    assert ratios["gb300x4x2"] > 1.5 * ratios["gb300-nvl72"] > 1.5
