"""The dry run's NCCL communicators and the groups that cross nodes (``cp_train/memory/communicators.py``)."""

from __future__ import annotations

from cp_train.config.sources import load_config
from cp_train.memory.communicators import COLLECTIVE_GIB, PEER_GIB, communicator_lines, communicators
from cp_train.memory.dry_run_report import report

CONFIG = "launch/configs/gpt-8b-128k-cp8.yaml"


def test_hsdp_keeps_fsdp_inside_a_node_and_holds_two_more_communicators() -> None:
    plain = communicators(load_config(CONFIG, overrides=["parallel.fsdp=true"]), 2, 8)
    hsdp = communicators(load_config(CONFIG, overrides=["parallel.fsdp=true", "parallel.dp_replicate=2"]), 2, 8)
    assert "dp_shard_cp" in plain.crossing and "dp_shard_cp" not in hsdp.crossing
    assert "dp_replicate" in hsdp.crossing and "cp" not in hsdp.crossing
    assert hsdp.gib - plain.gib == 2 * COLLECTIVE_GIB
    assert dict((kind, gib) for kind, _, gib in plain.used)["cp"] == COLLECTIVE_GIB + 2 * PEER_GIB  # the ring's peers
    lines = communicator_lines(hsdp)
    assert lines[0].startswith("NCCL communicators per rank: ~2.9 GiB of buffers") and "fsdp shard (8 ranks" in lines[0]
    assert lines[1] == "groups crossing nodes (8 ranks per node): dp, dp_cp, dp_replicate"


def test_ulysses_holds_an_all_to_all_communicator_with_a_peer_each(monkeypatch) -> None:
    found = communicators(load_config(CONFIG, overrides=["parallel.cp_algorithm=ulysses"]), 1, 8)
    assert ("cp all-to-all", 8, 7 * PEER_GIB) in found.used and found.crossing == ()


def test_the_dry_run_prints_them_on_cuda_only(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    config = load_config(CONFIG, overrides=["parallel.dp_replicate=2", "train.global_batch_size=2"])
    text = report(config, 16, 80.0, reserve_gib=7.0).text
    assert "HSDP: FSDP over dp/2 x cp (ZeRO-3), 2 replicas" in text
    assert "groups crossing nodes (8 ranks per node): dp, dp_cp, dp_replicate" in text
    cpu = load_config("launch/configs/cpu-tiny.yaml")
    assert "NCCL communicators" not in report(cpu, 2, 24.0).text
