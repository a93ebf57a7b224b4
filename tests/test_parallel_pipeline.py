"""Pipeline parallelism with every schedule, alone and composed with dp and tp, trains to the
single-process numbers; impossible pipelines are refused. (dp2 x pp2 with every schedule and
every ZeRO stage: tests/test_parallel_pipeline_zero.py.)"""

from __future__ import annotations

import pytest
from harness.parity import FULL_3D, SAVE_EVERY, Matrix, layouts, prefetch_selected

from parallel3d.base import ConfigError
from parallel3d.config.compose import compose
from parallel3d.parallel.pipeline import layer_split, stage_ids, stage_model
from parallel3d.validate import check

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]

# name: (ranks, overrides). Global batch 16, micro batch 2: 8 microbatches per dp rank at dp 1.
LAYOUTS = layouts({f"pp2-{s}": (2, ["parallel.pp=2", f"parallel.pp_schedule={s}", "train.micro_batch_size=2"])
                   for s in SCHEDULES})
LAYOUTS += layouts({
    "pp2-1F1B-accum": (2, ["parallel.pp=2", "parallel.pp_microbatches=4", "train.micro_batch_size=2"]),
    "pp2-1F1B-uneven": (2, ["parallel.pp=2", "parallel.pp_layers_per_stage=[1,3]", "train.micro_batch_size=2"]),
    "pp2-Interleaved1F1B-3-per-rank": (2, ["parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B",
                                           "parallel.pp_stages_per_rank=3", "train.micro_batch_size=2"]),
    "tp2-pp2-1F1B": (4, ["parallel.tp=2", "parallel.pp=2", "train.micro_batch_size=2"]),
    "tp2-pp2-ZBVZeroBubble": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble",
                                  "train.micro_batch_size=2"]),
    "dp2-tp2-pp2-1F1B": (8, ["parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=3",
                             "train.micro_batch_size=2"]),
    "dp2-tp2-pp2-Interleaved1F1B": (8, ["parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=2",
                                        "parallel.pp_schedule=Interleaved1F1B", "train.micro_batch_size=2"]),
    # the run tests/test_checkpoint.py saves and reshards ("3d-zero1"): trained once for both
    "dp2-tp2-pp2-1F1B-zero1": (8, [*FULL_3D, "parallel.zero_stage=1", f"checkpoint.every={SAVE_EVERY}"]),
    "hsdp2x2-pp2-Interleaved1F1B": (8, ["parallel.dp_replicate=2", "parallel.pp=2", "parallel.zero_stage=3",
                                        "parallel.pp_schedule=Interleaved1F1B", "train.micro_batch_size=2"]),
})


# Tied embeddings: the first stage's embedding and the last stage's copy stay one matrix, whether
# the two stages share a rank (V schedules) or not, under dp and tp too.
TIED_OVERRIDES = ["model.tie_embeddings=true", "train.micro_batch_size=2"]
TIED = layouts({
    "pp2-1F1B-tied": (2, ["parallel.pp=2", *TIED_OVERRIDES], True),
    "pp2-ZBVZeroBubble-tied": (2, ["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble", *TIED_OVERRIDES], True),
    "dp2-pp2-zero3-tied": (4, ["parallel.pp=2", "parallel.zero_stage=3", *TIED_OVERRIDES], True),
    "tp2-pp2-tied": (4, ["parallel.pp=2", "parallel.tp=2", *TIED_OVERRIDES], True),
})
MATRIX = Matrix(tuple(LAYOUTS + TIED))  # lent to other files' batches (harness/parity.py)


@pytest.fixture(scope="module", autouse=True)
def batched(parity, request):
    """The selected layouts train in a few launches instead of one each (tests/harness/layout_batch.py)."""
    prefetch_selected(request, parity, MATRIX)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_matches_single_process(layout, parity):
    parity.assert_same_training(parity.train(layout))


@pytest.mark.multirank
@pytest.mark.parametrize("layout", TIED, ids=str)
def test_tied_embeddings_match_single_process(layout, parity):
    parity.assert_same_training(parity.train(layout), tied=layout.tied)


@pytest.mark.parametrize("overrides,world_size,key", [
    (["parallel.pp=4", "train.micro_batch_size=8"], 4, "parallel.pp_microbatches"),  # 1F1B: 2 < 4 stages
    (["parallel.pp=2", "parallel.pp_schedule=DualPipeV", "train.micro_batch_size=8"], 2, "parallel.pp_microbatches"),
    (["parallel.pp=2", "parallel.pp_microbatches=3", "train.micro_batch_size=2"], 2, "parallel.pp_microbatches"),
    (["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble", "parallel.pp_stages_per_rank=3"], 2,
     "parallel.pp_stages_per_rank"),
    (["parallel.pp=2", "parallel.pp_layers_per_stage=[1,1]"], 2, "parallel.pp_layers_per_stage"),
    (["parallel.pp=4", "parallel.pp_schedule=Interleaved1F1B", "train.micro_batch_size=1"], 4, "parallel.pp"),
    (["parallel.pp=4", "parallel.pp_layers_per_stage=[2,0,0,2]", "train.micro_batch_size=1"], 4, "parallel.pp"),
    # 9 microbatches run in rounds of 2 (9 // pp): not a whole number of rounds
    (["parallel.pp=4", "parallel.pp_schedule=Interleaved1F1B", "model.n_layers=8", "train.global_batch_size=18",
      "train.micro_batch_size=2"], 4, "parallel.pp_microbatches"),
])
def test_impossible_pipelines_are_refused(overrides, world_size, key):
    with pytest.raises(ConfigError) as err:
        check(compose(overrides), world_size)
    assert err.value.key == key, str(err.value)


def test_as_many_microbatches_as_stages_is_enough_for_1f1b():
    check(compose(["parallel.pp=2", "train.micro_batch_size=8"]), 2)  # 16 / 8 = 2 microbatches, 2 stages


@pytest.mark.fast
def test_layer_split_counts_embedding_and_output_as_layers():
    assert layer_split(4, 2) == [range(0, 2), range(2, 4)]
    assert [len(r) for r in layer_split(8, 4)] == [2, 3, 2, 1]  # 10 units: 3,3,2,2 less embedding and output
    assert [len(r) for r in layer_split(6, 4)] == [1, 2, 2, 1]  # 8 units, 2 each; ends carry embedding/output
    assert layer_split(4, 2, [1, 3]) == [range(0, 1), range(1, 4)]


def test_stage_placement_looped_and_v():
    assert [stage_ids(r, 4, 2, "Interleaved1F1B") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stage_ids(r, 4, 2, "ZBVZeroBubble") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_stages_keep_full_model_parameter_names():
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_object(compose([]).model)
    first, last = stage_model(cfg, 0, 2, range(0, 2)), stage_model(cfg, 1, 2, range(2, 4))
    names = [n for n, _ in first.named_parameters()] + [n for n, _ in last.named_parameters()]
    import torch

    from parallel3d.models import Transformer

    with torch.device("meta"):
        full = [n for n, _ in Transformer(cfg).named_parameters()]
    assert sorted(names) == sorted(full)
    assert "layers.3.attention.wq.weight" in dict(last.named_parameters())


@pytest.mark.fast
def test_microbatch_rules_refuse_whatever_torchs_schedules_refuse():
    """pipeline.py's rules (which validation asks) against torch's own constructors: every count
    torch refuses is refused before any process group, for every schedule, 2 and 4 pp ranks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    from parallel3d.parallel.pipeline import fits_rounds, is_single_stage, min_microbatches, schedule_class, stages_per_rank

    for pp in (2, 4):
        dist.init_process_group("fake", rank=0, world_size=pp, store=FakeStore())
        try:
            for name in SCHEDULES:
                assert is_single_stage(name) == issubclass(schedule_class(name), PipelineScheduleSingle), name
                per_rank = stages_per_rank(name, None)
                ids = [0, 2 * pp - 1] if per_rank == 2 and name in ("ZBVZeroBubble", "DualPipeV") else \
                    [k * pp for k in range(per_rank)]
                stages = [PipelineStage(torch.nn.Linear(2, 2), i, pp * per_rank, torch.device("cpu")) for i in ids]
                for n in range(1, 3 * pp + 2):
                    try:
                        schedule_class(name)(stages[0] if per_rank == 1 else stages, n, loss_fn=lambda y, t: y.sum())
                    except ValueError:
                        assert n < min_microbatches(name, pp, pp * per_rank) or not fits_rounds(name, pp, n), (name, n)
        finally:
            dist.destroy_process_group()
