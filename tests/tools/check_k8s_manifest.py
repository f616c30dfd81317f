#!/usr/bin/env python3
"""Checks configs/kubernetes/lorastream.yaml: valid YAML, and the shape README "Several hosts"
describes. Every document a Kubernetes object; a coordinator Deployment of one replica with its
journal on a PersistentVolumeClaim and a Service on its port; a DaemonSet whose pod holds a
store and workers of one GPU each, all sharing /dev/shm from a memory-backed emptyDir, the
workers offering the store the store container serves and reaching the coordinator's Service;
every volume a container mounts declared by its pod. Exit status 0 when all hold, else 1 with
each problem on a line.

Usage: check_k8s_manifest.py MANIFEST.yaml
"""
import sys

import yaml


def arg_after(args, flag):
    return args[args.index(flag) + 1] if flag in args else None


def check(path):
    problems = []
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    by_kind = {}
    for i, d in enumerate(docs):
        for key in ("apiVersion", "kind", "metadata"):
            if key not in d:
                problems.append(f"document {i + 1}: no {key}")
        by_kind.setdefault(d.get("kind"), []).append(d)
    for kind in ("Deployment", "Service", "DaemonSet", "PersistentVolumeClaim"):
        if len(by_kind.get(kind, [])) != 1:
            problems.append(f"expected one {kind}, found {len(by_kind.get(kind, []))}")
    if problems:
        return problems

    def pod_checks(name, pod):
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes:
                    problems.append(f"{name}/{c['name']}: mounts {m['name']}, not a volume of the pod")
        return volumes

    coord = by_kind["Deployment"][0]
    if coord["spec"].get("replicas") != 1:
        problems.append("the coordinator Deployment must have one replica (one per journal)")
    pod = coord["spec"]["template"]["spec"]
    volumes = pod_checks("coordinator", pod)
    (c,) = pod["containers"]
    db = arg_after(c["args"], "--db") or ""
    journal = [m for m in c["volumeMounts"] if db.startswith(m["mountPath"] + "/")]
    if not journal or "persistentVolumeClaim" not in volumes[journal[0]["name"]]:
        problems.append(f"the journal {db} is not on a PersistentVolumeClaim")
    bind = arg_after(c["args"], "--bind") or ""
    port = int(bind.rsplit(":", 1)[-1]) if ":" in bind else None
    if "--curve-keys" not in c["args"]:
        problems.append("the coordinator listens on TCP without --curve-keys")
    service = by_kind["Service"][0]
    if service["spec"]["ports"][0]["targetPort"] != port:
        problems.append(f"the Service targets port {service['spec']['ports'][0]['targetPort']}, "
                        f"the coordinator binds {port}")

    node = by_kind["DaemonSet"][0]["spec"]["template"]["spec"]
    volumes = pod_checks("node", node)
    shm = [n for n, v in volumes.items() if v.get("emptyDir", {}).get("medium") == "Memory"]
    if not shm:
        problems.append("the node pod has no memory-backed emptyDir")
    stores = [c for c in node["containers"] if c["args"][0] == "serve" and "--name" in c["args"]]
    workers = [c for c in node["containers"] if "--coordinator" in c["args"]]
    if len(stores) != 1 or not workers:
        problems.append(f"the node pod needs one store and workers ({len(stores)}, {len(workers)})")
        return problems
    store_name = arg_after(stores[0]["args"], "--name")
    endpoint = f"tcp://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    for c in stores + workers:
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        if mounts.get("/dev/shm") not in shm:
            problems.append(f"{c['name']}: /dev/shm is not the memory-backed emptyDir")
    for w in workers:
        if w.get("resources", {}).get("limits", {}).get("nvidia.com/gpu") != 1:
            problems.append(f"{w['name']}: a worker takes exactly one GPU")
        if arg_after(w["args"], "--store") != store_name:
            problems.append(f"{w['name']}: offers store {arg_after(w['args'], '--store')}, "
                            f"the pod's store is {store_name}")
        if arg_after(w["args"], "--coordinator") != endpoint:
            problems.append(f"{w['name']}: reaches {arg_after(w['args'], '--coordinator')}, "
                            f"the coordinator's Service is {endpoint}")
        if "--curve-keys" not in w["args"]:
            problems.append(f"{w['name']}: no --curve-keys (TCP between hosts is CURVE only)")
    return problems


if __name__ == "__main__":
    found = check(sys.argv[1])
    for p in found:
        print(f"{sys.argv[1]}: {p}")
    print(f"{sys.argv[1]}: {'ok' if not found else f'{len(found)} problems'}")
    sys.exit(1 if found else 0)
