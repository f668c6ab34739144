"""One install recipe: scripts/install.sh is what `make install` (so `make test` and CI on a clean
clone) and both Docker images run; CI also runs the images' variant in a fresh environment. Here:
the commands each variant runs, and that nothing installs Python packages another way."""

import os
import re
import subprocess

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
    cpu = dry_run()
    assert cpu[0] == "python3 -m venv .venv"
    assert ".venv/bin/python -m pip install -q -c constraints.txt -e .[dev,tpu-aot]" in cpu
    assert not any("jax[tpu]" in c for c in cpu)
    tpu = dry_run("/opt/venv", "python3", "tpu", GRPO_DEV="0")
    assert "/opt/venv/bin/python -m pip install -q -c constraints.txt ." in tpu  # the image: not editable, no dev
    assert any(c.startswith(f"/opt/venv/bin/python -m pip install -q jax[tpu]=={jax} -f ") for c in tpu)
    bad = subprocess.run(["bash", "scripts/install.sh", ".venv", "python3", "gpu"], cwd=ROOT, capture_output=True)
    assert bad.returncode == 2 and b"variant must be cpu or tpu" in bad.stderr


def test_make_the_images_and_ci_use_the_script():
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    recipe = makefile.split("$(STAMP): ", 1)[1].split("\n\n", 1)[0]
    assert "scripts/install.sh $(VENV) $(PYTHON) cpu" in recipe and "pip install" not in recipe
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
