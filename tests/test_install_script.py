"""One install recipe: scripts/install.sh is what `make install` (so `make test` and CI on a clean
clone) and both Docker images run; CI also runs the images' variant in a fresh environment. Here:
the commands each variant runs, and that nothing installs Python packages another way."""

import os
import re
import shutil
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dry_run(*args: str, **env: str) -> list[str]:
    out = subprocess.run(
        ["bash", "scripts/install.sh", *args],
        cwd=ROOT,
        env={**os.environ, "GRPO_INSTALL_DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.splitlines()


def test_variants_install_what_the_constraints_pin():
    jax = re.search(r"^jax==(\S+)$", open(os.path.join(ROOT, "constraints.txt")).read(), re.M).group(1)
    cpu = dry_run()  # dev: what make test needs
    assert re.fullmatch(r"install: dev into \.venv with uv \(cpu\); this usually takes .+ on a 2-core machine", cpu[0])
    assert "python3 -m venv .venv" in cpu
    assert ".venv/bin/python -m pip install -q --target $BOOT -c constraints.txt uv" in cpu  # uv, pinned
    assert "$BOOT/bin/uv pip install --python .venv/bin/python -c constraints.txt -e .[dev,tpu-aot]" in cpu
    assert not any("jax[tpu]" in c for c in cpu)
    assert "install: bytecode of the packages a demo's install left as sources" in cpu
    demo = dry_run(".venv", "python3", "cpu", "demo")  # make demo: the project alone, editable
    assert "$BOOT/bin/uv pip install --python .venv/bin/python -c constraints.txt -e ." in demo
    assert not any("[dev" in c or "tpu-aot" in c for c in demo)
    assert "install: bytecode of what the demo imports" in demo
    assert not any("left as sources" in c for c in demo)
    tpu = dry_run("/opt/venv", "python3", "tpu", GRPO_DEV="0")
    assert "$BOOT/bin/uv pip install --python /opt/venv/bin/python -c constraints.txt ." in tpu  # the image
    assert any(c.startswith(f"$BOOT/bin/uv pip install --python /opt/venv/bin/python jax[tpu]=={jax} -f ") for c in tpu)
    pip = dry_run(".venv", "python3", "cpu", "demo", GRPO_INSTALLER="pip")
    assert ".venv/bin/python -m pip install --progress-bar on -c constraints.txt -e ." in pip
    for args, said in [
        (("gpu",), b"variant must be cpu or tpu"),
        (("cpu", "all"), b"level must be demo, dev or image"),
    ]:
        bad = subprocess.run(["bash", "scripts/install.sh", ".venv", "python3", *args], cwd=ROOT, capture_output=True)
        assert bad.returncode == 2 and said in bad.stderr


def test_make_demo_installs_the_demos_level_and_make_test_adds_the_dev_tools(tmp_path):
    """A stamp per level: `make demo` installs the project alone, `make test` the dev tools over it."""

    def planned(target: str) -> list[str]:
        out = subprocess.run(
            ["make", "-n", f"VENV={tmp_path}/venv", "SGLANG=0", target], cwd=ROOT, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return [line for line in out.stdout.splitlines() if line.startswith("scripts/install.sh")]

    demo = f"scripts/install.sh {tmp_path}/venv python3 cpu demo   # the images' recipe too (Dockerfile)"
    assert planned("demo") == [demo]
    assert planned("test") == [demo, f"scripts/install.sh {tmp_path}/venv python3 cpu dev"]


def test_make_the_images_and_ci_use_the_script():
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    for stamp, level in (("$(DEMO_STAMP)", "demo"), ("$(STAMP)", "dev")):
        recipe = makefile.split(f"\n{stamp}: ", 1)[1].split("\n\n", 1)[0]
        assert f"scripts/install.sh $(VENV) $(PYTHON) cpu {level}" in recipe and "pip install" not in recipe
    docker = open(os.path.join(ROOT, "Dockerfile")).read()
    runs = [line for line in docker.splitlines() if line.startswith("RUN ")]
    installs = [r for r in runs if "install" in r]
    assert {
        t for t in ("cpu", "tpu") if any(r.endswith(f"scripts/install.sh /opt/venv python3 {t}") for r in installs)
    } == {
        "cpu",
        "tpu",
    }
    assert not [r for r in installs if "pip" in r]
    assert re.findall(r"^FROM \S+ AS (\w+)", docker, re.M) == ["base", "cpu", "tpu"]
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert 'GRPO_DEV=0 scripts/install.sh "$image_venv" python3 cpu' in ci and ci.rstrip().endswith("make test")


@pytest.mark.slow
def test_the_demos_install_is_light_and_says_how_far_it_is(tmp_path):
    """scripts/install.sh demo for real, into a new environment (the packages from uv's cache once
    a make has filled it): a line at least every GRPO_INSTALL_TICK_S, none of the dev tools, the
    modules of the demo's processes importable, well under 1.5 GB."""
    venv, tick = tmp_path / "venv", 5
    env = dict(os.environ, GRPO_INSTALL_TICK_S=str(tick))
    cmd = ["bash", "scripts/install.sh", str(venv), "python3", "cpu", "demo"]
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = [(time.monotonic(), line.rstrip("\n")) for line in proc.stdout]
        assert proc.wait() == 0, "\n".join(line for _, line in lines[-30:])
        said = [line for _, line in lines]
        assert re.fullmatch(r"install: demo into \S+ with uv \(cpu\); this usually takes .+", said[0])
        assert re.fullmatch(r"install: demo installed in \S+ in \d+ (s|min \d+ s)", said[-1])
        assert "install: bytecode of what the demo imports" in said
        gaps = [b - a for (a, _), (b, _) in zip(lines, lines[1:])]
        assert max(gaps) < tick + 5, [(round(g), line) for g, (_, line) in zip(gaps, lines[1:]) if g >= tick + 5]
        probe = (
            "import importlib.util as u, flows.pipeline, tasks.stages, grpo_core.stages.worker as w; w.preload(); "
            "print([m for m in ('torch', 'ray', 'wandb', 'mlflow', 'selenium', 'libtpu', 'pytest') if u.find_spec(m)])"
        )
        out = subprocess.run([venv / "bin" / "python", "-c", probe], cwd=tmp_path, capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-3000:]
        kib = int(subprocess.run(["du", "-sk", venv], capture_output=True, text=True, check=True).stdout.split()[0])
        assert kib < 1.5e9 / 1024, f"{kib / 2**20:.2f} GiB"
    finally:
        shutil.rmtree(venv, ignore_errors=True)
