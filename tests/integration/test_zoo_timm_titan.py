"""Models nobody here wrote, trained 3 SGD steps against eager: timm networks whose
BatchNorm is timm's ``BatchNormAct2d`` (a BatchNorm subclass with its own forward: batch
norm, then an activation), timm's CaiT (a region fed inputs of two layouts) and
torchtitan's MoE model from its own code."""

from __future__ import annotations

import pytest

from aotdist.check import check_family
from aotdist.check.families_titan import titan_unavailable
from aotdist.compile.verify import tolerance

pytestmark = [pytest.mark.slow, pytest.mark.zoo, pytest.mark.filterwarnings("ignore")]


def _trains_with_parity(result) -> None:
    assert result.ok and result.steps == 3, result.line() + "\n" + result.error
    # BatchNormAct2d runs as timm wrote it; its running statistics (and MoE's token counts)
    # are written back by each call site, so no region is demoted for a buffer write
    assert result.status in ("reused", "partly reused"), result.line()
    assert "buffer" not in str(result.notes), result.line()
    rtol = tolerance("aot_eager")
    assert result.max_grad_diff <= rtol and result.max_buffer_diff <= rtol, result.line()
    assert result.max_loss_diff <= rtol * max(1.0, abs(result.loss_eager)), result.line()
    if result.status in ("partly reused", "demoted"):  # what is not kept is named
        assert set(result.notes) - {"gradients", "later steps"} <= set(result.regions), (
            result.line()
        )


@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch", ["regnetx_002"])  # efficientnet_b0 too: aotdist zoo
def test_timm_batchnorm_act_networks_train_with_eager_s_losses_gradients_and_statistics(arch):
    pytest.importorskip("timm")
    result = check_family(f"timm:{arch}", whole_model=False)
    _trains_with_parity(result)
    assert result.stochastic_depth, result.line()  # built with drop_path_rate=0.1


@pytest.mark.timeout(900)
def test_timm_regions_nested_in_regions_train_with_parity():
    # resnext26ts: a BatchNormAct2d region inside ConvNormAct regions and at the top level;
    # AOTAutograd's tracer once named a nested backward subgraph by a dotted path it could
    # not read back (AttributeError 'repeated_subgraph16.repeated_subgraph1'), demoting it
    pytest.importorskip("timm")
    result = check_family("timm:resnext26ts", whole_model=False)
    _trains_with_parity(result)
    assert "nested" not in str(result.notes) and "repeated_subgraph" not in str(result.notes), (
        result.line()
    )
    assert any(n.startswith("ConvNormAct") for n in result.regions), result.line()


@pytest.mark.timeout(900)
def test_timm_class_attention_blocks_share_one_subgraph_across_input_layouts():
    # CaiT: the first class-attention block gets the class token expanded over the batch
    # (stride 0), the second the first's output; torch traced a second subgraph for it
    pytest.importorskip("timm")
    result = check_family("timm:cait_xxs24_224", whole_model=False)
    _trains_with_parity(result)
    blocks = result.regions["LayerScaleBlockClassAttn"]
    assert (blocks["call_sites"], blocks["subgraphs"]) == (2, 1), result.line()
    assert result.status == "reused", result.line()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["qwen3_moe"])  # deepseek_v3 too: aotdist zoo
def test_torchtitan_moe_models_train_with_parity(name):
    pytest.importorskip("torchtitan")
    missing = titan_unavailable(name)
    if missing:
        pytest.skip(missing)
    result = check_family(f"titan:{name}", whole_model=False)
    _trains_with_parity(result)
