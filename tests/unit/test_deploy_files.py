"""docker-compose.yml, the Dockerfile and the Kubernetes manifests, read as files and checked
against the code: they parse, every setting they pass is one the settings read, every part of
the product is in each, and their ports, probes and shutdown times are the code's. (They also
run: Compose in tests/system/test_compose.py; the image, with each part started as its manifest
says, in tests/system/test_installed.py on the container backend. Kubernetes itself does not
run here.)"""

from __future__ import annotations

import re
import tomllib

import yaml
from pipeline import REPO

from memfilter.settings import RELAY_RETENTION_MS, VARIABLES, Settings, Topics

PARTS = {"worker", "agent", "sink", "embedder", "gateway"}
# The setting each part's web server listens on (`memfilter.settings`).
PORT_SETTINGS = {
    "worker": "MEMFILTER_WEB_PORT",
    "agent": "MEMFILTER_AGENT_WEB_PORT",
    "sink": "MEMFILTER_SINK_WEB_PORT",
    "embedder": "MEMFILTER_EMBEDDER_WEB_PORT",
    "gateway": "MEMFILTER_GATEWAY_PORT",
}


def names_the_settings_read() -> set[str]:
    return set(VARIABLES)


def test_every_setting_read_is_documented():
    documented = (REPO / "docs" / "settings.md").read_text()
    for name in names_the_settings_read():
        assert f"`{name}`" in documented, f"{name} is read but missing from docs/settings.md"


def test_the_port_settings_are_the_parts_defaults_and_each_its_own():
    defaults = Settings.from_env({})
    ports = {defaults.worker.web_port, defaults.agent.web_port, defaults.postgres.sink_web_port, defaults.gateway.port, defaults.recall.web_port}
    assert ports == {6066, 6067, 6068, 6069, 6070}
    assert set(PORT_SETTINGS.values()) <= names_the_settings_read()


class TestCompose:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]

    def test_it_runs_kafka_redis_postgresql_the_topics_and_every_part_with_settings_they_read(self):
        assert {"kafka", "redis", "postgres", "topics", "worker-1", "worker-2", "sink", "agent", "gateway"} <= self.services.keys()
        assert self.services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft
        created = " ".join(self.services["topics"]["command"]).replace(";", " ").split()
        assert set(Topics().all()) <= set(created)
        assert f"retention.ms={RELAY_RETENTION_MS}" in created  # the relay topics copy content: kept an hour
        for name in ("worker-1", "worker-2", "sink", "agent", "embedder", "gateway"):
            part = self.services[name]
            assert part["image"] == "memfilter/memfilter" and part["environment"].keys() <= names_the_settings_read()
            assert part["environment"]["KAFKA_BOOTSTRAP_SERVERS"] == "kafka:19092"
            assert part["environment"]["MEMFILTER_SECRET"].startswith("${MEMFILTER_SECRET:?")  # never a fixed one
            assert "/readyz" in " ".join(part["healthcheck"]["test"])
        for name in ("sink", "agent", "embedder", "gateway"):
            assert self.services[name]["command"][:2] == ["memfilter", name]
        assert self.services["embedder"]["profiles"] == ["recall"]  # off unless asked for: each embedding is a paid call

    def test_the_chat_page_is_on_the_hosts_loopback_port_6068(self):
        gateway = self.services["gateway"]
        assert gateway["ports"] == ["127.0.0.1:${MEMFILTER_GATEWAY_PORT:-6068}:6068"]
        assert gateway["environment"]["MEMFILTER_GATEWAY_PORT"] == "6068" and gateway["environment"]["MEMFILTER_GATEWAY_BIND"] == "0.0.0.0"
        assert "127.0.0.1:6068/readyz" in " ".join(gateway["healthcheck"]["test"])


class TestTheImage:
    dockerfile = (REPO / "Dockerfile").read_text()

    def test_it_carries_every_extra_of_the_product(self):
        extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"].keys() - {"test", "dev"}
        installed = re.search(r"for extra in \(([^)]*)\)", self.dockerfile).group(1)
        assert {e.strip(" '\"") for e in installed.split(",")} == extras

    def test_it_runs_the_worker_with_its_web_servers_reachable(self):
        assert 'CMD ["memfilter", "worker"' in self.dockerfile
        env_line = next(line for line in self.dockerfile.splitlines() if line.startswith("ENV MEMFILTER_"))
        names = {pair.split("=")[0] for pair in env_line.removeprefix("ENV ").split()}
        assert names <= names_the_settings_read() and "MEMFILTER_WEB_BIND=0.0.0.0" in env_line and "MEMFILTER_GATEWAY_BIND=0.0.0.0" in env_line
        assert "EXPOSE 6066 6067 6068 6069 6070" in self.dockerfile


class TestKubernetes:
    documents = [d for f in sorted((REPO / "deploy" / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    kinds = [d["kind"] for d in documents]
    [config] = [d for d in documents if d["kind"] == "ConfigMap"]
    deployments = {d["spec"]["template"]["spec"]["containers"][0]["name"]: d for d in documents if d["kind"] == "Deployment"}
    secret_keys = set(re.findall(r"--from-literal=([a-z-]+)=", (REPO / "deploy" / "k8s" / "config.yaml").read_text()))

    def test_every_part_is_a_deployment_of_the_products_image_taking_its_settings_from_the_configmap(self):
        assert self.deployments.keys() == PARTS
        assert self.config["data"].keys() <= names_the_settings_read()
        for name, deployment in self.deployments.items():
            pod = deployment["spec"]["template"]["spec"]
            [container] = pod["containers"]
            assert container["image"].startswith("memfilter/memfilter:") and container["command"][:2] == ["memfilter", name]
            assert container["envFrom"] == [{"configMapRef": {"name": self.config["metadata"]["name"]}}]
            assert pod["enableServiceLinks"] is False  # no WEB_PORT=tcp://... injected
            assert deployment["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()

    def test_secrets_come_from_the_secret_the_configmaps_file_says_how_to_make(self):
        for name, deployment in self.deployments.items():
            [container] = deployment["spec"]["template"]["spec"]["containers"]
            for e in container.get("env", []):
                if e["name"] in ("POD_IP", "MEMFILTER_GATEWAY_ADDRESS"):
                    continue  # the pod's own address (test_the_gateways_share_the_partitions_each_reached_at_its_pod)
                assert e["name"] in names_the_settings_read() and e["name"] not in self.config["data"], (name, e["name"])
                assert e["valueFrom"]["secretKeyRef"]["key"] in self.secret_keys, (name, e)
            taken = {e["name"] for e in container.get("env", [])}
            wanted = {"MEMFILTER_SECRET"} if name not in ("sink", "embedder") else set()  # they sign and verify nothing
            assert wanted | ({"POSTGRES_URL"} if name != "agent" else set()) <= taken, name

    def test_the_gateways_share_the_partitions_each_reached_at_its_pod(self):
        [container] = self.deployments["gateway"]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["MEMFILTER_GATEWAY_ADDRESS"]["value"] == "http://$(POD_IP):$(MEMFILTER_GATEWAY_PORT)" and "MEMFILTER_GATEWAY_PORT" in self.config["data"]
        assert "MEMFILTER_GATEWAY_ADDRESS" in names_the_settings_read()

    def test_each_part_listens_where_its_probes_and_scrapes_look(self):
        data = self.config["data"]
        assert data["MEMFILTER_WEB_BIND"] == "0.0.0.0" and data["MEMFILTER_GATEWAY_BIND"] == "0.0.0.0"
        for name, deployment in self.deployments.items():
            template = deployment["spec"]["template"]
            [container] = template["spec"]["containers"]
            [port] = container["ports"]
            assert port["containerPort"] == int(data[PORT_SETTINGS[name]]), name
            for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
                assert container[probe]["httpGet"] == {"path": path, "port": port["name"]}, (name, probe)
            assert template["metadata"]["annotations"]["prometheus.io/port"] == str(port["containerPort"])
            assert template["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"

    def test_each_part_is_given_the_time_the_code_takes_to_stop_and_has_resources(self):
        shutdown_s = Settings.from_env(self.config["data"]).worker.shutdown_s
        for name, deployment in self.deployments.items():
            pod = deployment["spec"]["template"]["spec"]
            assert shutdown_s < pod["terminationGracePeriodSeconds"] <= shutdown_s + 30, name  # exits within MEMFILTER_SHUTDOWN_S of SIGTERM
            resources = pod["containers"][0]["resources"]
            assert {"cpu", "memory"} <= resources["requests"].keys() and "memory" in resources["limits"], name
            assert pod["securityContext"]["runAsNonRoot"] is True

    def test_workers_leave_one_at_a_time_and_the_gateway_has_a_service(self):
        [budget] = [d for d in self.documents if d["kind"] == "PodDisruptionBudget"]
        worker = self.deployments["worker"]
        assert budget["spec"]["selector"]["matchLabels"] == worker["spec"]["selector"]["matchLabels"] and budget["spec"]["maxUnavailable"] == 1
        services = {d["metadata"]["name"]: d for d in self.documents if d["kind"] == "Service"}
        gateway = services["memfilter-gateway"]
        assert gateway["spec"]["selector"] == self.deployments["gateway"]["spec"]["selector"]["matchLabels"]
        assert gateway["spec"]["ports"][0]["targetPort"] == "web"
