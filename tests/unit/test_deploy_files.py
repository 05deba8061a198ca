"""docker-compose.yml, the Dockerfile and the Kubernetes manifests, read as files: they parse,
and every setting they pass is one the worker reads. (The compose file and the images also
run, in tests/test_compose.py and on the container backend; Kubernetes does not run here.)"""

from __future__ import annotations

import yaml
from pipeline import REPO

from memfilter.settings import RELAY_RETENTION_MS, VARIABLES, Topics


def names_the_worker_reads() -> set[str]:
    return set(VARIABLES)


def test_every_setting_read_is_documented():
    documented = (REPO / "docs" / "settings.md").read_text()
    for name in names_the_worker_reads():
        assert f"`{name}`" in documented, f"{name} is read but missing from docs/settings.md"


def test_compose_runs_kafka_redis_topics_two_workers_and_the_agent_with_settings_they_read():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"kafka", "redis", "topics", "worker-1", "worker-2", "agent"} <= services.keys()
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft
    created = " ".join(services["topics"]["command"]).replace(";", " ").split()
    assert set(Topics().all()) <= set(created)
    assert f"retention.ms={RELAY_RETENTION_MS}" in created  # the relay topics copy content: kept an hour
    read = names_the_worker_reads()
    for name in ("worker-1", "worker-2", "agent"):
        worker = services[name]
        assert worker["image"] == "memfilter/worker" and worker["environment"].keys() <= read
        assert worker["environment"]["KAFKA_BOOTSTRAP_SERVERS"] == "kafka:19092"
        assert worker["environment"]["MEMFILTER_SECRET"].startswith("${MEMFILTER_SECRET:?")  # never a fixed one
        assert "/readyz" in " ".join(worker["healthcheck"]["test"])
    assert services["agent"]["command"][:2] == ["memfilter", "agent"]


def test_the_image_runs_the_worker_with_its_web_server_reachable():
    dockerfile = (REPO / "Dockerfile").read_text()
    assert 'CMD ["memfilter", "worker"' in dockerfile
    env_line = next(line for line in dockerfile.splitlines() if line.startswith("ENV MEMFILTER_"))
    names = {pair.split("=")[0] for pair in env_line.removeprefix("ENV ").split()}
    assert names <= names_the_worker_reads() and "MEMFILTER_WEB_BIND=0.0.0.0" in env_line


def test_kubernetes_workers_take_settings_from_a_configmap_and_are_ready_on_readyz():
    docs = {d["kind"]: d for d in yaml.safe_load_all((REPO / "deploy" / "k8s" / "worker.yaml").read_text())}
    assert docs.keys() == {"ConfigMap", "Deployment", "Service"}
    assert docs["ConfigMap"]["data"].keys() <= names_the_worker_reads()
    pod = docs["Deployment"]["spec"]["template"]
    [container] = pod["spec"]["containers"]
    assert container["envFrom"] == [{"configMapRef": {"name": docs["ConfigMap"]["metadata"]["name"]}}]
    assert [e["name"] for e in container["env"]] == ["MEMFILTER_SECRET"] and "secretKeyRef" in container["env"][0]["valueFrom"]
    assert pod["spec"]["enableServiceLinks"] is False
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    port = int(docs["ConfigMap"]["data"]["MEMFILTER_WEB_PORT"])
    assert container["ports"][0]["containerPort"] == port
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert docs["Service"]["spec"]["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]
