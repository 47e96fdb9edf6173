"""`aotbuild bench`: statistics and report on recorded figures, and one short real run."""

from __future__ import annotations

import json
import re
import shutil
import threading

import pytest
from click.testing import CliRunner

from aotbuild.benchmarking.harness import CASES, FIGURES, _eta
from aotbuild.benchmarking.report import format_table, report
from aotbuild.benchmarking.stats import ratios_to_aot, summarize
from aotbuild.builder.targets import load_target
from aotbuild.cli import main
from aotbuild.runtime import extracted_package

from .conftest import TARGETS, build_once, eager_pipeline

RECORDED = {  # two repetitions; aot's figures drift upward on the second, so must the ratios' inputs
    "eager": [{"first_step_s": 4.0, "steady_step_s": 0.030}, {"first_step_s": 4.4, "steady_step_s": 0.033}],
    "aot": [{"first_step_s": 2.0, "steady_step_s": 0.010}, {"first_step_s": 4.4, "steady_step_s": 0.011}],
}


def test_summarize_median_and_spread_ignoring_missing():
    assert summarize([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "values": [3.0, 1.0, 2.0]}
    assert summarize([None, None])["median"] is None
    assert summarize([1.0, None, 3.0])["median"] == 2.0


def test_ratios_are_paired_by_repetition():
    ratios = ratios_to_aot(RECORDED, ("first_step_s", "steady_step_s"))
    assert ratios["eager"]["first_step_s"] == pytest.approx((4.0 / 2.0 + 4.4 / 4.4) / 2)  # not 4.2 / 3.2
    assert ratios["eager"]["steady_step_s"] == pytest.approx((3.0 + 3.0) / 2)
    assert ratios["aot"]["first_step_s"] == 1.0


def test_report_and_table_format():
    document = report(RECORDED, {"torch": "x"}, {"target": "t"}, FIGURES)
    assert set(document) == {"meta", "environment", "figures", "runs", "summary", "ratio_to_aot"}
    assert document["summary"]["eager"]["first_step_s"]["median"] == pytest.approx(4.2)
    lines = format_table(document).splitlines()
    assert lines[0].split() == ["figure", "eager", "aot"]
    assert [line.split()[0] for line in lines[1:3]] == ["first_step_s", "steady_step_s"]  # no row of dashes
    half = report({"eager": [{"ready_s": 1.0}], "aot": [{}]}, {}, {}, {"ready_s": "x", "first_step_s": "x"})
    assert format_table(half, ()).splitlines()[1].split() == ["ready_s", "1", "-"]  # a figure one case measured
    row = next(line for line in lines if line.startswith("first_step_s"))
    assert row.split() == ["first_step_s", "4.2", "[4,", "4.4]", "3.2", "[2,", "4.4]"]
    wide = report({"aot": [{"first_step_s": -4.06e-05}, {"first_step_s": -5.1e-05}, {"first_step_s": -3e-05}]},
                  {}, {}, {"first_step_s": "x"})  # a cell wider than its column stays apart from the next
    assert format_table(wide, ("first_step_s",)).splitlines()[1].split() == ["first_step_s", "-4.06e-05",
                                                                             "[-5.1e-05,", "-3e-05]"]
    one = report({"aot": [{"first_step_s": 2.0}]}, {}, {}, {"first_step_s": "x"})  # one run: the figure alone
    assert format_table(one, ("first_step_s",)).splitlines()[1].split() == ["first_step_s", "2"]
    assert any(line.split()[:3] == ["first_step_s", "1.50x", "1.00x"] for line in lines)


@pytest.mark.slow
def test_package_cache_is_safe_under_concurrent_extraction(built, tmp_path, monkeypatch):
    monkeypatch.setenv("AOTBUILD_CACHE", str(tmp_path))
    package = built.folder / "unet.pt2"
    sha = built.manifest["files"]["unet.pt2"]["sha256"]
    results = []
    threads = [threading.Thread(target=lambda: results.append(extracted_package(package, sha))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and results[0].name == sha
    assert [p.name for p in (tmp_path / "packages").iterdir()] == [sha]  # no partial folders left
    assert list(results[0].glob("*/data/aotinductor/b1_64x64/*.so"))


def test_progress_says_the_time_left_from_each_cases_mean(monkeypatch):
    monkeypatch.setattr("aotbuild.benchmarking.harness.time.perf_counter", lambda: 250.0)
    assert _eta(0.0, {"eager": 20.0, "compile": 0.0, "aot": 0.0}, 0, "compile", 3) == " (elapsed 4m10s)"
    # Before repetition 2's compile (eager has run twice, the others once; means 20, 200, 10 s):
    # compile and aot left in it, then a whole repetition: 210 + 230 s.
    seconds = {"eager": 40.0, "compile": 200.0, "aot": 10.0}
    assert _eta(0.0, seconds, 1, "compile", 3) == " (elapsed 4m10s, ~7m20s left)"


@pytest.mark.slow
@pytest.mark.early  # tiny LTX-Video: the first target built
def test_short_real_bench_has_every_case_and_figure(tmp_path_factory, tmp_path):
    # LTX-Video: the cheapest target to torch.compile twice (its VAE runs eager), and a video: its bucket's
    # frames and text length are the call's. The cases are the same for all.
    target = load_target(TARGETS / "cpu-tiny-ltx.toml")
    folder = build_once(tmp_path_factory, target).folder
    artifacts = tmp_path / "artifacts"  # bench.json goes into the artifact: use a copy
    shutil.copytree(folder, artifacts / folder.name)
    plot = tmp_path / "bench.png"
    result = CliRunner().invoke(main, [  # --quick: 1 repetition of 2 steps, 1 steady image; its cases given
        "bench", "--target", str(TARGETS / "cpu-tiny-ltx.toml"), "--artifacts", str(artifacts),
        "--quick", "--cases", ",".join(CASES), "--plot", str(plot)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "[bench] repetition 1/1: eager (elapsed 0m" in result.output
    document = json.loads((artifacts / folder.name / "bench.json").read_text())  # written as the repetition ended
    assert list(document["runs"]) == list(CASES) and document["meta"]["repeats_done"] == 1
    assert (document["meta"]["steps"], document["meta"]["steady_runs"]) == (2, 1)
    assert "build_s" not in result.output  # no row of dashes for what no case measured
    for case in CASES:
        run = document["runs"][case][0]
        assert set(run) == set(FIGURES)
        for figure in ("ready_s", "first_step_s", "first_image_s", "steady_step_s", "steady_image_s", "peak_rss_mib"):
            assert run[figure] > 0
        assert run["first_step_s"] >= run["ready_s"]
    assert document["runs"]["aot"][0]["artifact_mib"] > 0 and document["ratio_to_aot"]["aot"]["first_step_s"] == 1
    assert document["environment"]["torch"] and document["meta"]["shape"] == "1x32x64/9frames/text16"
    # Its random weights were saved once and every case read them from disk: none made any.
    assert re.fullmatch(r"random:tiny-ltx \(seed 0\), saved: [\d.]+ MiB in [\d.]+ s", document["meta"]["source"])
    assert all(document["runs"][case][0]["random_init_s"] == 0 for case in CASES)
    assert "ratio to aot" in result.output and plot.stat().st_size > 10_000


@pytest.mark.slow
def test_peer_cases_run_the_whole_pipeline_with_the_peers_denoiser(built, tmp_path):
    """The peers on the whole pipeline, each in fresh processes: the denoiser converted once per
    converter (OpenVINO's two precisions share it), its time the case's build_s, the saved model
    read cold; the table's ratios put them beside aot."""
    artifacts = tmp_path / "artifacts"
    shutil.copytree(built.folder, artifacts / built.folder.name)
    result = CliRunner().invoke(main, [
        "bench", "--target", str(TARGETS / "cpu-tiny-sdxl.toml"), "--artifacts", str(artifacts),
        "--cases", "aot,openvino,openvino-f32,onnxruntime", "--repeats", "1", "--steps", "2", "--steady", "1"],
        catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.output.count("[bench] converting the denoiser for") == 2  # OpenVINO once, ONNX Runtime once
    document = json.loads((artifacts / built.folder.name / "bench.json").read_text())
    assert list(document["runs"]) == ["aot", "openvino", "openvino-f32", "onnxruntime"]
    assert document["meta"]["skipped"] == {}
    runs = {case: figures[0] for case, figures in document["runs"].items()}
    for case in ("openvino", "openvino-f32", "onnxruntime"):
        run = runs[case]
        assert run["build_s"] > 0 and run["artifact_mib"] > 1 and run["steady_step_s"] > 0, (case, run)
        assert run["package_mib"] is None and document["ratio_to_aot"][case]["steady_step_s"] > 0
    assert runs["openvino"]["build_s"] == runs["openvino-f32"]["build_s"]  # one conversion, loaded twice
    assert runs["openvino-f32"]["peer"]["precision"] == "f32" and runs["onnxruntime"]["peer"]["precision"] == "f32"
    bf16 = tmp_path / "cpu-tiny-sdxl-bf16.toml"
    bf16.write_text((TARGETS / "cpu-tiny-sdxl.toml").read_text().replace('dtype = "float32"', 'dtype = "bfloat16"')
                    .replace('name = "cpu-tiny-sdxl"', 'name = "cpu-tiny-sdxl-bf16"'))
    (tmp_path / "configs").symlink_to(TARGETS / "configs")
    refused = CliRunner().invoke(main, ["bench", "--target", str(bf16), "--artifacts", str(artifacts),
                                        "--cases", "onnxruntime"])
    assert refused.exit_code == 1 and "the peer cases run the float32 model; cpu-tiny-sdxl-bf16 is bfloat16" in \
        refused.output


def test_lora_switch_case_measures_switches_against_their_floor(built, tmp_path, monkeypatch):
    # A package cache of its own: the suite's background builders extract packages into the shared
    # one meanwhile, and those files are not the switches'.
    monkeypatch.setenv("AOTBUILD_CACHE", str(tmp_path / "cache"))
    artifacts = tmp_path / "artifacts"
    shutil.copytree(built.folder, artifacts / built.folder.name)
    result = CliRunner().invoke(main, [
        "bench", "--target", str(TARGETS / "cpu-tiny-sdxl.toml"), "--artifacts", str(artifacts), "--cases", "aot-lora",
        "--repeats", "1", "--steps", "2", "--steady", "1"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    run = json.loads((artifacts / built.folder.name / "bench.json").read_text())["runs"]["aot-lora"][0]
    assert run["lora_switch_s"] > 0 and run["lora_load_switch_s"] > 0 and run["lora_floor_s"] > 0
    assert run["lora_switch_over_floor"] > 0 and run["lora_load_switch_over_floor"] > 0
    assert run["lora_new_files"] == 0  # a switch compiles and extracts nothing
    assert 0 < run["lora_touched_mib"] == run["lora_buffers_mib"] < 1 and run["first_image_s"] > 0


def test_bench_without_artifact_or_with_unknown_case(tmp_path):
    result = CliRunner().invoke(main, ["bench", "--target", str(TARGETS / "cpu-tiny-sdxl.toml"),
                                       "--artifacts", str(tmp_path)])
    assert result.exit_code == 1 and "no artifact at" in result.output
    result = CliRunner().invoke(main, ["bench", "--target", str(TARGETS / "cpu-tiny-sdxl.toml"),
                                       "--artifacts", str(tmp_path), "--cases", "aot,warp"])
    assert result.exit_code == 1 and "unknown bench case 'warp'" in result.output
    result = CliRunner().invoke(main, ["bench", "--target", str(TARGETS / "cpu-tiny-sd15.toml"),
                                       "--artifacts", str(tmp_path), "--cases", "aot-tiling"])
    assert result.exit_code == 1 and ("case aot-tiling needs vae_decoder = { tiling = true } and a first bucket "
                                      "larger than a tile (64 px); cpu-tiny-sd15 lacks one") in result.output
    result = CliRunner().invoke(main, ["bench", "--target", str(TARGETS / "cpu-tiny-sdxl.toml"),
                                       "--artifacts", str(tmp_path), "--cases", "aot-cache"])
    assert result.exit_code == 1 and ("case aot-cache: cpu-tiny-sdxl's unet (UNet2DConditionModel) has no step "
                                      "caches in diffusers") in result.output
    result = CliRunner().invoke(main, ["bench", "--target", str(TARGETS / "cpu-tiny-sdxl.toml"),
                                       "--artifacts", str(tmp_path), "--cache-threshold", "0.3"])
    assert result.exit_code == 1 and "--cache-threshold goes with case aot-cache" in result.output


@pytest.mark.slow
def test_cache_case_times_first_block_cache_against_uncached(tmp_path_factory, tmp_path):
    """On tiny regional Flux, 6 steps: a threshold that skips blocks changes the image and is
    recorded; one below every step's change skips nothing and the images are the same."""
    target = load_target(TARGETS / "cpu-tiny-flux-regional.toml")
    folder = build_once(tmp_path_factory, target).folder
    artifacts = tmp_path / "artifacts"
    shutil.copytree(folder, artifacts / folder.name)
    for threshold in ("0.4", "0.01"):
        result = CliRunner().invoke(main, [
            "bench", "--target", str(TARGETS / "cpu-tiny-flux-regional.toml"), "--artifacts", str(artifacts),
            "--cases", "aot-cache", "--repeats", "1", "--steps", "6", "--steady", "1", "--cache-threshold", threshold],
            catch_exceptions=False)
        assert result.exit_code == 0, result.output
        run = json.loads((artifacts / folder.name / "bench.json").read_text())["runs"]["aot-cache"][0]
        assert run["cached_image_s"] > 0 and run["uncached_image_s"] > 0 and run["cached_over_uncached"] > 0
        assert run["cache_threshold"] == float(threshold)
        assert (run["cache_max_abs"] > 1e-3) if threshold == "0.4" else (run["cache_max_abs"] == 0)


@pytest.mark.slow
def test_component_bench_runs_every_runtime_on_the_pipelines_own_call(built, tmp_path):
    """aot, the model alone, eager and the three peers on tiny SDXL's UNet call at 1x64x64, in one
    process: each output against eager float32, the document written and read back."""
    artifacts = tmp_path / "artifacts"
    shutil.copytree(built.folder, artifacts / built.folder.name)
    result = CliRunner().invoke(main, ["bench", "--target", str(TARGETS / "cpu-tiny-sdxl.toml"), "--artifacts",
                                       str(artifacts), "--component", "unet", "--rounds", "3"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    document = json.loads((artifacts / built.folder.name / "bench-unet.json").read_text())
    runtimes = document["runtimes"]
    assert list(runtimes) == ["aot", "aot-model", "eager", "openvino", "openvino-f32", "onnxruntime"]
    assert document["skipped"] == {} and document["meta"]["shape"] == "1x64x64" and document["meta"]["rounds"] == 3
    # OpenVINO's own precision is bf16 on a CPU with AMX or AVX512-BF16, f32 elsewhere: it says which.
    bf16 = {"openvino"} if runtimes["openvino"]["precision"] == "bf16" else set()
    for case, figures in runtimes.items():
        bound = 1e-6 if case == "eager" else 5e-2 if case in bf16 else 1e-4  # float32: rounding alone
        assert figures["max_rel_error"] < bound, case
        assert len(figures["values"]) == 3 and figures["call_s"] > 0 and figures["ratio_to_aot"] > 0
        assert figures["first_call_s"] > 0
    assert runtimes["aot"]["ratio_to_aot"] == 1 and runtimes["aot-model"]["variant"] == "b1_64x64"
    for case, figures in runtimes.items():  # the spread of the per-round ratios, around their median
        ratios = [value / aot for value, aot in zip(figures["values"], runtimes["aot"]["values"], strict=True)]
        first, third = figures["ratio_quartiles"]
        assert min(ratios) <= first <= figures["ratio_to_aot"] <= third <= max(ratios), case
    assert runtimes["aot"]["ratio_quartiles"] == [1, 1] and "middle half" in result.output
    assert runtimes["openvino-f32"]["precision"] == "f32"
    assert runtimes["openvino"]["convert_s"] == runtimes["openvino-f32"]["convert_s"] > 0  # converted once
    assert all(runtimes[case]["disk_mib"] > 0 for case in ("aot", "openvino", "onnxruntime"))
    assert isinstance(document["meta"]["stand_in_us"], float)
    assert "onnxruntime" in result.output and "the stand-in's own cost per call" in result.output


def test_component_bench_times_the_vae_decoder_against_its_decoded_reference(built, tmp_path):
    """The decoder's call is recorded undecoded (`capture.recording`); the bench's reference decodes
    it before comparing: each output against eager float32."""
    artifacts = tmp_path / "artifacts"
    shutil.copytree(built.folder, artifacts / built.folder.name)
    result = CliRunner().invoke(main, ["bench", "--target", str(TARGETS / "cpu-tiny-sdxl.toml"), "--artifacts",
                                       str(artifacts), "--component", "vae_decoder", "--cases", "aot,eager",
                                       "--rounds", "1"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    runtimes = json.loads((artifacts / built.folder.name / "bench-vae_decoder.json").read_text())["runtimes"]
    assert runtimes["eager"]["max_rel_error"] < 1e-6 and runtimes["aot"]["max_rel_error"] < 1e-4


def test_component_bench_refuses_what_it_cannot_time(tmp_path):
    from aotbuild.benchmarking.peers import Peer

    def bench(*extra):
        return CliRunner().invoke(main, ["bench", "--target", str(TARGETS / "cpu-tiny-sdxl.toml"),
                                         "--artifacts", str(tmp_path), *extra])

    result = bench("--component", "transformer")
    assert result.exit_code == 1 and "cpu-tiny-sdxl compiles unet, vae_decoder, vae_encoder; not 'transformer'" \
        in result.output
    result = CliRunner().invoke(main, ["bench", "--target", str(TARGETS / "h200-sdxl-random.toml"),
                                       "--component", "unet"])
    assert result.exit_code == 1 and "--component times CPU runtimes; h200-sdxl-random is a cuda target" \
        in result.output and "aotbuild bench --target h200-sdxl-random times eager" in result.output
    result = bench("--component", "unet", "--cases", "aot-model")
    assert result.exit_code == 1 and "case aot-model needs case aot" in result.output
    result = bench("--component", "unet", "--cases", "aot,tensorrt")
    assert result.exit_code == 1 and "unknown case 'tensorrt' for --component" in result.output
    result = bench("--component", "unet")
    assert result.exit_code == 1 and "no artifact at" in result.output
    result = bench("--component", "unet", "--steps", "3")
    assert result.exit_code == 1 and "--component takes --rounds" in result.output
    result = bench("--busy", "2")
    assert result.exit_code == 1 and "--rounds, --busy and --against go with --component" in result.output
    result = bench("--component", "unet", "--against", str(TARGETS / "cpu-tiny-sd15.toml"))
    assert result.exit_code == 1 and ("--against cpu-tiny-sd15: compared with cpu-tiny-sdxl's unet, it must be "
                                      "another target of StableDiffusionXLPipeline that compiles unet") in result.output
    result = bench("--component", "unet", "--cases", "eager", "--against", str(TARGETS / "cpu-tiny-sdxl-int8.toml"))
    assert result.exit_code == 1 and "--against compares other builds with case aot" in result.output
    missing = Peer("nothing", "aotbuild_no_such_runtime", None, None, "").missing()
    assert missing == "aotbuild_no_such_runtime is not installed (pip install 'aotbuild[peers]')"


@pytest.mark.slow
def test_growth_reads_the_builds_and_calls_of_several_targets(built, built_bf16_prepack, bf16_prepack_target,
                                                              tmp_path):
    """`bench --growth`: each build's time, compile time, peak RSS and parameters from its manifest,
    each runtime's call from its `bench --component` document, seconds per GFLOP against the
    first target's; the plot drawn; what it cannot compare refused."""
    artifacts = tmp_path / "artifacts"
    names = ["cpu-tiny-sdxl", "cpu-tiny-sdxl-bf16-prepack"]
    for made in (built, built_bf16_prepack):
        shutil.copytree(made.folder, artifacts / made.folder.name)
    for name in names:
        timed = CliRunner().invoke(main, ["bench", "--target", str(TARGETS / f"{name}.toml"), "--artifacts",
                                          str(artifacts), "--component", "unet", "--rounds", "1", "--cases",
                                          "aot,eager"], catch_exceptions=False)
        assert timed.exit_code == 0, timed.output

    def growth(*extra):
        return CliRunner().invoke(main, ["bench", "--target", str(TARGETS / f"{names[0]}.toml"), "--artifacts",
                                         str(artifacts), "--component", "unet", *extra])

    result = growth("--growth", str(TARGETS / f"{names[1]}.toml"), "--plot", str(tmp_path / "growth.png"))
    assert result.exit_code == 0, result.output
    document = json.loads((artifacts / "growth-unet.json").read_text())
    builds, calls = document["builds"], document["calls"]
    assert [b["target"] for b in builds] == [c["target"] for c in calls] == names
    for row, made in zip(builds, (built, built_bf16_prepack), strict=True):
        assert row["build_s"] == pytest.approx(sum(made.manifest["timings"].values()))
        assert row["compile_s"] == made.manifest["components"]["unet"]["compile_s"] > 0
        assert row["peak_rss_mib"] == max(made.manifest["peak_rss_mib"].values())
    # the bf16 recipe compiles the UNet alone (its q, k and v fused): the eager UNet's parameters
    assert builds[1]["parameters"] == sum(p.numel() for p in eager_pipeline(bf16_prepack_target).unet.parameters())
    assert builds[0]["build_s_per_parameter_vs_first"] == 1
    for row in calls:
        bench = json.loads((artifacts / row["target"] / "bench-unet.json").read_text())
        assert row["gflop"] == bench["meta"]["gflop"] > 0
        assert row["call_s"] == {case: figures["call_s"] for case, figures in bench["runtimes"].items()}
    assert calls[0]["s_per_gflop_vs_first"] == {"aot": 1, "eager": 1}
    per_gflop = [row["call_s"]["aot"] / row["gflop"] for row in calls]
    assert calls[1]["s_per_gflop_vs_first"]["aot"] == pytest.approx(per_gflop[1] / per_gflop[0])
    assert "s/param x first" in result.output and (tmp_path / "growth.png").stat().st_size > 10_000

    result = growth("--growth", "")
    assert result.exit_code == 1 and "--growth compares two targets or more" in result.output
    result = growth("--growth", str(TARGETS / f"{names[1]}.toml"), "--rounds", "3")
    assert result.exit_code == 1 and "--growth reads what was measured" in result.output
    result = CliRunner().invoke(main, ["bench", "--target", str(TARGETS / f"{names[0]}.toml"), "--artifacts",
                                       str(artifacts), "--component", "vae_decoder", "--growth",
                                       str(TARGETS / f"{names[1]}.toml")])
    assert result.exit_code == 1 and "cpu-tiny-sdxl-bf16-prepack compiles unet; not 'vae_decoder'" in result.output


def test_the_component_bench_counts_attention_flops():
    """A denoiser's FLOPs include its attention's two matmuls: torch's FlopCounterMode has no
    formula for ATen's CPU flash attention, which counted 0 (the published GFLOP/s of every CPU
    component bench left SDXL's self-attention out: 1.57 of 13.5 TFLOP at 1024 px)."""
    from types import SimpleNamespace

    import torch

    from aotbuild.benchmarking.component import call_flop

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 64)

        def forward(self, x):
            q = self.proj(x).unflatten(-1, (4, 16)).transpose(1, 2)
            return torch.nn.functional.scaled_dot_product_attention(q, q, q)

    call = SimpleNamespace(args=(torch.randn(2, 128, 64),), kwargs={})
    linear, attention = 2 * (2 * 128) * 64 * 64, 2 * (2 * 2 * 4 * 128 * 128 * 16)
    assert call_flop(Attention(), call) == linear + attention
