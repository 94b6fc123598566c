"""The seams between model families and the rest of titan, checked on the source."""

import ast
import re
from pathlib import Path

import pytest
import torch

from titan.models.spec import (
    Model,
    ModelArgs,
    TrainSpec,
    get_train_spec,
    register_train_spec,
    registered_names,
)
from titan.runtime.paths import REPO_ROOT

TITAN = REPO_ROOT / "titan"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside functions, relative imports resolved."""
    package = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


FAMILIES = registered_names()


def family_folder(path: Path) -> str | None:
    """The registered family whose folder (titan/models/<family>/) holds `path`."""
    rel = path.relative_to(TITAN).parts
    return rel[1] if len(rel) > 2 and rel[0] == "models" and rel[1] in FAMILIES else None


def generic_files() -> list[Path]:
    """Everything that must work for any model family: all of titan but the families
    themselves (titan/models/<family>/ and the registry's import lines), titan/models/common
    included, and the scripts."""
    files = [
        p
        for p in TITAN.rglob("*.py")
        if family_folder(p) is None and p != TITAN / "models" / "__init__.py"
    ]
    return files + sorted((REPO_ROOT / "scripts").glob("*.py"))


@pytest.mark.parametrize("folder", ["components", "parallelisms", "models/common", "planner"])
def test_generic_folders_exist_and_are_scanned(folder):
    assert any(TITAN / folder in p.parents for p in generic_files())


def imports_a_family(module: str) -> str | None:
    return next(
        (
            f
            for f in FAMILIES
            if module == f"titan.models.{f}" or module.startswith(f"titan.models.{f}.")
        ),
        None,
    )


def test_no_generic_module_imports_a_model_family():
    assert {"llama3", "qwen3"} <= set(FAMILIES)
    offenders = {
        str(p.relative_to(REPO_ROOT)): sorted(m for m in imported_modules(p) if imports_a_family(m))
        for p in generic_files()
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_families_do_not_import_each_other():
    offenders = {
        str(p.relative_to(REPO_ROOT)): sorted(
            m for m in imported_modules(p) if imports_a_family(m) not in (None, family_folder(p))
        )
        for p in TITAN.rglob("*.py")
        if family_folder(p)
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_scan_sees_family_imports():
    # the checks above would pass vacuously if they could not see an import of a family
    assert imports_a_family("titan.models.llama3.args") == "llama3"
    assert "titan.models.llama3.args" in imported_modules(TITAN / "models" / "llama3" / "model.py")
    assert "titan.models.qwen3_5.args" in imported_modules(
        TITAN / "models" / "qwen3_5" / "__init__.py"
    )
    assert TITAN / "models" / "common" / "attention.py" in generic_files()


def test_the_test_family_builds_on_common_only():
    from tests.families import gelu_llama

    used = {imports_a_family(m) for m in imported_modules(Path(gelu_llama.__file__))}
    assert used == {None}


def test_one_dtype_name_map():
    """Only titan/runtime/dtypes.py maps dtype names to torch dtypes."""

    def maps_names_to_dtypes(node) -> bool:
        return isinstance(node, ast.Dict) and any(
            isinstance(k, ast.Constant)
            and isinstance(k.value, str)
            and isinstance(v, ast.Attribute)
            and v.attr in ("bfloat16", "float32", "float16")
            for k, v in zip(node.keys, node.values)
        )

    found = [
        str(p.relative_to(REPO_ROOT))
        for p in TITAN.rglob("*.py")
        if any(maps_names_to_dtypes(n) for n in ast.walk(ast.parse(p.read_text())))
    ]
    assert found == ["titan/runtime/dtypes.py"]


@pytest.mark.parametrize("family", FAMILIES)
def test_registered_family_satisfies_the_protocols(family):
    spec = get_train_spec(family)
    for args in spec.flavors.values():
        assert isinstance(args, ModelArgs)
    model = spec.build_meta(spec.flavors["debugmodel"])
    assert isinstance(model, Model)
    ((rope, dim),) = model.cp_buffers()
    assert rope is model.rope and dim == 0


def test_registration_rejects_a_model_without_the_contract():
    llama = get_train_spec("llama3")
    with pytest.raises(TypeError, match="cp_buffers"):
        register_train_spec(
            TrainSpec(
                name="broken",
                model_cls=torch.nn.Linear,
                flavors=llama.flavors,
                parallelize_fn=llama.parallelize_fn,
            )
        )


def test_multi_stage_schedules_match_torch():
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    from titan.parallelisms.pipeline import MULTI_STAGE, SCHEDULES

    assert set(MULTI_STAGE) == {
        s for s in SCHEDULES if issubclass(get_schedule_class(s), PipelineScheduleMulti)
    }


def test_config_check_stays_light(tmp_path):
    """The launcher validates every job before torchrun starts (and tests launch ~100 jobs):
    it must not import DTensor, FSDP, pipelining or DCP, a second or more each."""
    import subprocess
    import sys

    # the launcher's plan, with every plan check of a run about to start (the data's content,
    # the checkpoint folders, the memory plan: the memory check once imported DTensor)
    code = (
        "import sys; from titan.config import parse_args; from titan.launcher.launch import "
        "validate_world_sizes; "
        "job = parse_args(['--parallelism.pipeline_parallel_degree', '2', "
        "'--checkpoint.enable', '--job.dump_folder', sys.argv[1]]); "
        "plan = validate_world_sizes(job, 1, 1, 2); "
        "heavy = [m for m in ('torch.distributed.tensor', 'torch.distributed.fsdp', "
        "'torch.distributed.pipelining', 'torch.distributed.checkpoint') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "fresh")],
        check=True,
        timeout=120,
        cwd=REPO_ROOT,
    )


# ----------------------------------------------------------------------------- family seams

OPTIONAL_MEMBERS_PROBED = re.compile(
    r"(?:hasattr|getattr)\([^()]*[\"'](training_knobs|context_len|moe_args|moe|is_moe_layer|"
    r"problems|layer_costs|export_problems|moe_bias_update_rate|"
    r"masked_labels_problem)[\"']"
)


def _family_folders() -> list[str]:
    return sorted(
        p.parent.name for p in (TITAN / "models").glob("*/__init__.py") if p.parent.name != "common"
    )


@pytest.mark.parametrize("family", _family_folders())
def test_a_family_needs_no_file_outside_its_folder_but_its_registration_line(family):
    """What adding this family took outside titan/models/<family>/: the one import line in
    titan/models/__init__.py, and nothing else (no generic module names it)."""
    pattern = re.compile(rf"\bmodels[./]{family}\b|\bimport {family}\b")
    naming = {}
    for path in TITAN.rglob("*.py"):
        if path.is_relative_to(TITAN / "models" / family):
            continue
        lines = [ln for ln in path.read_text().splitlines() if pattern.search(ln)]
        if lines:
            naming[str(path.relative_to(REPO_ROOT))] = lines
    assert naming == {"titan/models/__init__.py": [f"import titan.models.{family}  # noqa: F401"]}


def test_generic_code_calls_the_declared_members_instead_of_probing():
    """Optional members of ModelArgs and the adapter are declared with defaults
    (titan/models/args_base.py, DecoderHFAdapter); generic code calls them. Only the
    registration check asks whether they exist, and the identity record reads nested
    settings' knobs (an MoE's, which are no ModelArgs)."""
    allowed = {"titan/models/spec.py", "titan/components/checkpoint/identity.py"}
    probing = {}
    for path in TITAN.rglob("*.py"):
        rel = str(path.relative_to(REPO_ROOT))
        if rel in allowed or any(
            path.is_relative_to(TITAN / "models" / f) for f in _family_folders()
        ):
            continue
        found = OPTIONAL_MEMBERS_PROBED.findall(path.read_text())
        if found:
            probing[rel] = found
    assert probing == {}
    assert OPTIONAL_MEMBERS_PROBED.search('moe = getattr(args, "moe", None)')  # it can fail


def test_registration_names_the_base_that_declares_the_optional_members():
    from dataclasses import dataclass, replace

    @dataclass(frozen=True)
    class BareArgs:
        dim: int = 8
        n_layers: int = 1
        n_heads: int = 1
        n_kv_heads: int = 1
        head_dim: int = 8
        vocab_size: int = 8
        max_seq_len: int = 8

        def num_params(self, include_embedding=True, active=False):
            return 0

        def flops_per_token(self, seq_len):
            return 0.0

        def with_updates(self, **kw):
            return replace(self, **kw)

    llama = get_train_spec("llama3")
    with pytest.raises(TypeError, match="inherit titan.models.args_base.ModelArgsBase"):
        register_train_spec(
            TrainSpec(
                name="bare",
                model_cls=llama.model_cls,
                flavors={"x": BareArgs()},
                parallelize_fn=llama.parallelize_fn,
            )
        )


# ----------------------------------------------------------------------------- the house

# titan's packages from the bottom up: each imports only those below it
LAYERS = [
    "runtime",
    "config",
    "parallelisms",
    "models",
    "components",
    "plan",
    "assembly",
    "trainer",
    "planner",
    "launcher",
    "tools",
]
# module names users typed before the packages: each only runs what it is called now
MOVED = "titan.runtime.moved"
OLD_NAMES = {"train.py": "titan.trainer", "generate.py": "titan.tools.generate"}


def test_the_top_level_is_the_packages_and_no_import_points_up():
    top = sorted(p.name for p in TITAN.iterdir() if p.name != "__pycache__")
    assert top == sorted(["__init__.py", *LAYERS, *OLD_NAMES])
    for name in OLD_NAMES:
        assert imported_modules(TITAN / name) <= {
            "titan.runtime.moved",
            "titan.runtime.moved.run_moved",
        }
    upward = []
    for path in TITAN.rglob("*.py"):
        mine = path.relative_to(TITAN).parts[0]
        if mine == "__init__.py" or mine in OLD_NAMES:
            continue
        for module in imported_modules(path):
            other = module.split(".")[1] if module.startswith("titan.") else None
            if other in LAYERS and LAYERS.index(other) > LAYERS.index(mine):
                upward.append(f"{path.relative_to(REPO_ROOT)} imports {module}")
    assert upward == []
    # the scan can see one: parallelisms below models
    assert "titan.models.common.aux_loss" in imported_modules(
        TITAN / "models" / "common" / "moe.py"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_every_flavor_answers_the_declared_members(family):
    """Generic code calls them on any flavor: a dense one's moe_args() is None, not an
    error."""
    for name, args in get_train_spec(family).flavors.items():
        moe = args.moe_args()
        assert moe is None or moe.n_experts >= 1, name
        assert isinstance(args.problems(), list), name
        costs = args.layer_costs()
        assert costs is None or len(costs) == args.n_layers, name
        assert isinstance(args.is_moe_layer(0), bool) and (
            moe is not None or not any(args.is_moe_layer(i) for i in range(args.n_layers))
        ), name
        assert isinstance(type(args).training_knobs, tuple), name


# ----------------------------------------------------------------------------- the open trainer

# training features reach the trainer through its seams (model converters, the named batch,
# the objective, callbacks, components' own sections), never by name
FEATURES = re.compile(r"lora|float8|chunk|mtp|chat|doc_ids", re.IGNORECASE)
# and what is a hook in nature is a callback: garbage collection, stragglers, the metrics
# writers, profiler traces, memory snapshots
HOOKS = re.compile(r"\bgc\b|straggler|rank_times\b|writer|profil|snapshot", re.IGNORECASE)


def test_the_trainer_names_no_training_feature():
    found = [
        f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()}"
        for path in sorted((TITAN / "trainer").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if FEATURES.search(line)
    ]
    assert found == []
    # the scan sees them where they live
    assert FEATURES.search((TITAN / "components" / "lora" / "spec.py").read_text())


def test_the_loop_calls_no_hook_by_name():
    train = (TITAN / "trainer" / "train.py").read_text().splitlines()
    found = [
        f"train.py:{n}: {line.strip()}" for n, line in enumerate(train, 1) if HOOKS.search(line)
    ]
    assert found == []
    from titan.components.training import callbacks
    from titan.config import extensions

    extensions.sections()  # loads titan's own registrations
    want = [
        *(
            "memory_measured",
            "gc",
            "rank_times",
            "metrics_writers",
            "ema",
            "validation",
            "profiler",
            "memory_snapshot",
        ),
        *("stability", "eval"),
    ]
    assert list(callbacks._CALLBACKS.entries)[: len(want)] == want


def test_components_own_their_sections():
    """job_config.py holds the core sections; every other built-in section is registered by
    the component it configures (its dataclass lives there, with its checks)."""
    import dataclasses

    from titan.config import JobConfig, extensions

    job = JobConfig()
    core = [
        f.name for f in dataclasses.fields(job) if dataclasses.is_dataclass(getattr(job, f.name))
    ]
    assert core == ["job", "model", "training", "parallelism", "comm", "memory"]
    owners = {name: type(section).__module__ for name, section in extensions.sections().items()}
    assert {"optimizer", "checkpoint", "metrics", "validation", "profiling"} <= set(owners)
    assert not [n for n, m in owners.items() if m.startswith("titan.config")], owners
