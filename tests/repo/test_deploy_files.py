"""The deployment files under docs/deploy (docs/deploy.md): each Dockerfile's RUN steps are
README.md's install commands, in README's order; the Helm chart renders with Helm's own
template engine (helm-python-sdk, Helm's Go SDK in a wheel: no helm binary, no cluster), lints
clean, and every rendered manifest validates against the Kubernetes schemas
(kubernetes-validate, strict: an unknown field fails); the rendered objects keep the
invariants a deployment relies on (probes on /health, Prometheus scrape annotations, the API
key from a Secret as VLLM_API_KEY, model and flags from values)."""

from __future__ import annotations

import base64
import importlib.util
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "docs" / "deploy"
CHART = DEPLOY / "helm" / "trillm"
KUBERNETES = "1.30.0"  # the oldest minor the chart is validated against (1.30, April 2024)

needs_helm = pytest.mark.skipif(
    importlib.util.find_spec("helm_python") is None, reason="helm-python-sdk (the test extra)"
)
needs_schemas = pytest.mark.skipif(
    importlib.util.find_spec("kubernetes_validate") is None,
    reason="kubernetes-validate (the test extra)",
)


# ---------------------------------------------------------------- Dockerfiles vs README


def readme_install_commands() -> list[str]:
    """The commands of README's install block: the first ```bash block after the line that
    names docs/deploy/Dockerfile, comments and blank lines left out."""
    text = (ROOT / "README.md").read_text()
    at = text.index("docs/deploy/Dockerfile")
    block = re.search(r"```bash\n(.*?)```", text[at:], re.S)
    assert block is not None, "README: no ```bash block after docs/deploy/Dockerfile"
    lines = [line.strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def run_steps(dockerfile: Path) -> list[str]:
    """A Dockerfile's RUN commands (shell form), continuation lines joined."""
    text = dockerfile.read_text().replace("\\\n", " ")
    steps = []
    for line in text.splitlines():
        if line.startswith("RUN "):
            steps.append(" ".join(line[4:].split()))
    return steps


def normalized(command: str) -> list[str]:
    return shlex.split(command)


@pytest.mark.parametrize(
    ("dockerfile", "extra"),
    [("Dockerfile", '".[otel]"'), ("Dockerfile.cuda", '".[gpu,otel]"')],
)
def test_dockerfile_runs_the_readme_install_commands(dockerfile, extra):
    readme = readme_install_commands()
    steps = run_steps(DEPLOY / dockerfile)
    assert steps, dockerfile
    positions = []
    for step in steps:
        matches = [i for i, c in enumerate(readme) if normalized(c) == normalized(step)]
        assert matches, f"{dockerfile}: RUN {step!r} is not one of README's install commands"
        positions.append(matches[0])
    assert positions == sorted(positions), f"{dockerfile}: RUN steps out of README's order"
    assert f"pip install -e {extra}" in steps
    assert 'ENTRYPOINT ["trillm", "serve"]' in (DEPLOY / dockerfile).read_text()


def test_every_readme_install_command_is_in_an_image():
    used = {c for name in ("Dockerfile", "Dockerfile.cuda") for c in run_steps(DEPLOY / name)}
    assert set(readme_install_commands()) == used


def test_only_the_cpu_image_takes_torch_from_the_cpu_index():
    """The CUDA image's torch is PyPI's (its Linux wheel is the CUDA build), pulled in by the
    install of trillm itself."""
    assert any("torch --index-url" in s for s in run_steps(DEPLOY / "Dockerfile"))
    assert not any("torch" in s for s in run_steps(DEPLOY / "Dockerfile.cuda"))


def test_the_images_leave_the_hosts_build_outputs_out():
    for name in ("Dockerfile", "Dockerfile.cuda"):
        ignored = (DEPLOY / f"{name}.dockerignore").read_text().split()
        assert {"build", "**/*.so", ".git"} <= set(ignored), name


# ---------------------------------------------------------------- the Helm chart

FULL_VALUES: dict[str, Any] = {
    "model": "/models/Qwen2.5-0.5B-Instruct",
    "servedModelName": "qwen",
    "extraArgs": ["--max-model-len", "4096"],
    "apiKey": {"value": "s3cret"},
    "gpus": 2,
    "modelVolume": {"persistentVolumeClaim": "models"},
    "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """The chart rendered by Helm's template engine, as the objects it makes."""
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name="demo", namespace="serving")
    docs = []
    for text in manifests.values():
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds = [d["kind"] for d in docs]
    assert len(kinds) == len(set(kinds)), kinds
    return {d["kind"]: d for d in docs}


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = by_kind(docs)["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


@needs_helm
def test_the_chart_lints_clean():
    import helm_python as helm

    report = helm.lint(CHART)
    assert report["errors"] == []
    assert all(m["severity"] <= 1 for m in report["messages"]), report  # 1: info


@needs_helm
@needs_schemas
@pytest.mark.parametrize("values", [{}, FULL_VALUES], ids=["defaults", "full"])
def test_every_rendered_manifest_is_valid_kubernetes(values):
    import kubernetes_validate

    docs = render(values)
    assert {d["kind"] for d in docs} >= {"Deployment", "Service"}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


@needs_schemas
def test_the_validator_refuses_a_misspelt_field():
    """The schema check above can fail: strict validation names an unknown field."""
    import kubernetes_validate

    bad = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "x"},
        "spec": {"prots": [{"port": 80}]},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES, strict=True)


@needs_helm
@pytest.mark.parametrize("values", [{}, FULL_VALUES], ids=["defaults", "full"])
def test_probes_ask_health_on_the_served_port(values):
    docs = render(values)
    c = container(docs)
    (port,) = c["ports"]
    assert port["name"] == "http"
    assert c["args"][c["args"].index("--port") + 1] == str(port["containerPort"])
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    service = by_kind(docs)["Service"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    pod_labels = by_kind(docs)["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


@needs_helm
def test_pods_carry_the_prometheus_scrape_annotations():
    pod = by_kind(render({}))["Deployment"]["spec"]["template"]["metadata"]
    assert pod["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8000",
        "prometheus.io/path": "/metrics",
    }
    off = by_kind(render({"metrics": {"scrape": False}}))["Deployment"]
    assert "prometheus.io/scrape" not in (off["spec"]["template"]["metadata"]["annotations"] or {})


@needs_helm
def test_the_api_key_reaches_vllm_api_key_from_a_secret():
    docs = by_kind(render(FULL_VALUES))
    (env,) = [e for e in container(list(docs.values()))["env"] if e["name"] == "VLLM_API_KEY"]
    ref = env["valueFrom"]["secretKeyRef"]
    secret = docs["Secret"]
    assert ref["name"] == secret["metadata"]["name"]
    assert base64.b64decode(secret["data"][ref["key"]]) == b"s3cret"
    assert "value" not in env  # never the key itself in the pod spec


@needs_helm
def test_an_existing_secret_is_referenced_and_none_is_made():
    docs = render({"apiKey": {"existingSecret": "team-key", "secretKey": "token"}})
    assert "Secret" not in by_kind(docs)
    (env,) = container(docs)["env"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "team-key", "key": "token"}


@needs_helm
def test_without_a_key_no_secret_and_no_variable():
    docs = render({})
    assert "Secret" not in by_kind(docs)
    assert "env" not in container(docs)


@needs_helm
def test_model_flags_and_resources_come_from_values():
    c = container(render(FULL_VALUES))
    args = c["args"]
    assert args[0] == "/models/Qwen2.5-0.5B-Instruct"
    assert args[args.index("--served-model-name") + 1] == "qwen"
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[-2:] == ["--max-model-len", "4096"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True
    assert "/dev/shm" in mounts  # the workers' shared-memory rings outgrow Docker's 64 MiB
    assert {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"} in c["env"]
    defaults = container(render({}))
    assert defaults["args"][0] == "--host"  # no MODEL: the embedded default model
    assert "nvidia.com/gpu" not in defaults["resources"]["limits"]
