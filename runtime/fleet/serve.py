"""`pagedjax fleet serve`: the OpenAI API, /health, /metrics and the console in front of
N engine replicas on Ray Serve.

The gateway (this process) runs the same Litestar app as `pagedjax serve`, with a
FleetClient in place of the engine. `--replicas N` starts a local Ray instance;
`--address` (or RAY_ADDRESS) joins an existing cluster. Each replica is one Ray Serve
replica of the `engine` deployment, routed by PrefixAwareRouter, reporting to the
FleetHub actor. With --max-replicas above --min-replicas the proactive autoscaler
(runtime/fleet/autoscale.py) sizes the deployment.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("pagedjax.fleet")

APP_NAME = "pagedjax"
DEPLOYMENT = "engine"
# Disaggregated mode: one application (and deployment) per pool, same replica class.
POOLS = ("prefill", "decode")


def add_fleet_parser(sub: Any) -> None:
    from console.serve import add_server_arguments
    from runtime.core.engine_args import add_engine_arguments

    f = sub.add_parser("fleet", help="serve across replicas on Ray Serve (prefix-aware router, autoscaler)")
    fsub = f.add_subparsers(dest="fleet_command", required=True)
    s = fsub.add_parser("serve", help="the OpenAI API and console in front of N engine replicas",
                        description="Serve the OpenAI API, /health, /metrics and the console in front of N "
                                    "replicas on Ray Serve, routed by longest cached prefix, then most free blocks.")
    add_server_arguments(s)
    g = s.add_argument_group("fleet")
    g.add_argument("--replicas", type=int, default=None, help="replicas at start (default 2)")
    g.add_argument("--prefill-replicas", type=int, default=0,
                   help="disaggregated prefill/decode: replicas that only run prompts and ship their KV "
                        "(with --decode-replicas; default 0: colocated)")
    g.add_argument("--decode-replicas", type=int, default=0,
                   help="disaggregated prefill/decode: replicas that reserve blocks, receive the KV and generate")
    g.add_argument("--kv-transfer-timeout", type=float, default=10.0,
                   help="disaggregated: seconds a decode replica waits for a prompt's KV before the transfer fails")
    g.add_argument("--kv-reservation-lease", type=float, default=5.0,
                   help="disaggregated: seconds a decode replica keeps a reservation its gateway stopped renewing "
                        "(the gateway renews it while the prompt is prefilled)")
    g.add_argument("--address", default=None,
                   help="join this Ray cluster (default: $RAY_ADDRESS, else start a local Ray instance)")
    g.add_argument("--threads-per-replica", type=int, default=0,
                   help="CPU cores each replica pins and sizes XLA to (default: cores / replicas on a local "
                        "instance; 0 on a cluster = all the node gives it)")
    g.add_argument("--router", choices=("prefix", "default"), default="prefix",
                   help="prefix: the KV-aware router; default: Ray Serve's power-of-two-choices (for comparison)")
    g.add_argument("--imbalance", type=int, default=16,
                   help="skip a replica whose queue is this many requests longer than the least loaded one's")
    g.add_argument("--fleet-queue-cap", type=int, default=256,
                   help="requests that may wait at the gateway while no replica has room; beyond: 429")
    g.add_argument("--fleet-queue-timeout", type=float, default=30.0)
    g.add_argument("--min-replicas", type=int, default=None, help="autoscaling floor (default: --replicas)")
    g.add_argument("--max-replicas", type=int, default=None,
                   help="autoscaling ceiling; above --min-replicas turns the autoscaler on (disaggregated: the "
                        "most replicas both pools may grow to from the console)")
    g.add_argument("--scale-horizon", type=float, default=60.0,
                   help="seconds a new replica takes to start: the queue must clear within it")
    g.add_argument("--scale-in-delay", type=float, default=60.0)
    g.add_argument("--target-utilization", type=float, default=0.8)
    g.add_argument("--kv-events-endpoint", default=None,
                   help="also publish each replica's KV events on ZMQ, as vLLM does (e.g. tcp://*:5557; replica "
                        "k binds port + k), for consumers outside the fleet")
    g.add_argument("--kv-events-topic", default="", help="ZMQ topic of those messages (default: empty, as vLLM)")
    g.add_argument("--drain-timeout", type=float, default=120.0,
                   help="seconds a replica being scaled in gets to finish its requests")
    add_engine_arguments(s, serving=True)
    s.set_defaults(func=cmd_fleet_serve, requires=("ray",))  # checked before the command runs (runtime/cli.py)


def _one_line(exc: BaseException) -> str:
    """Ray wraps a replica's start-up failure in pages of traceback; keep its last error line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    errs = [ln for ln in lines if ":" in ln and ln.split(":", 1)[0].replace(".", "").isidentifier()
            and ln.split(":", 1)[0].split(".")[-1].endswith(("Error", "Exception"))]
    return (errs[-1] if errs else (lines[-1] if lines else type(exc).__name__))[:400]


def disaggregated(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "prefill_replicas", 0) or getattr(args, "decode_replicas", 0))


def deployment_options(args: argparse.Namespace, threads: int, pool: str | None = None) -> dict[str, Any]:
    from ray.serve.config import RequestRouterConfig

    opts: dict[str, Any] = {
        "name": pool or DEPLOYMENT,
        "max_ongoing_requests": 100_000,    # the engine queues and admits; Ray must not hold requests back
        "ray_actor_options": {"num_cpus": threads or 1},
        "graceful_shutdown_timeout_s": args.drain_timeout,
        "graceful_shutdown_wait_loop_s": 1.0,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
    }
    if args.router == "prefix":
        from runtime.fleet.ray_router import PrefixAwareRouter

        opts["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAwareRouter,
            request_router_kwargs={"imbalance": args.imbalance},
            request_routing_stats_period_s=0.5, request_routing_stats_timeout_s=5.0)
    if pool is not None:  # a disaggregated pool: fixed size
        opts["num_replicas"] = args.prefill_replicas if pool == "prefill" else args.decode_replicas
        return opts
    lo = args.min_replicas or args.replicas
    hi = args.max_replicas or args.replicas
    if hi > lo:
        from runtime.fleet.autoscale import ProactivePolicy

        opts["autoscaling_config"] = {
            "min_replicas": lo, "max_replicas": hi, "initial_replicas": args.replicas,
            "upscale_delay_s": 0.0, "downscale_delay_s": 0.0, "look_back_period_s": 2.0,
            "metrics_interval_s": 0.5,
            "policy": {"policy_function": ProactivePolicy,
                       "policy_kwargs": {"min_replicas": lo, "max_replicas": hi,
                                         "horizon_s": args.scale_horizon, "scale_in_delay_s": args.scale_in_delay,
                                         "target_utilization": args.target_utilization,
                                         "scale_in_utilization": min(0.4, args.target_utilization / 2)}}}
    else:
        opts["num_replicas"] = args.replicas
    return opts


class Fleet:
    """The running fleet as the gateway holds it: Ray, the hub, the deployment handle."""

    def __init__(self, args: argparse.Namespace, checkpoint: Path) -> None:
        self.args, self.checkpoint = args, checkpoint
        self.hub: Any = None
        self.handle: Any = None
        self.pools: dict[str, Any] = {}  # disaggregated: pool -> its deployment handle
        self.pool_specs: dict[str, dict[str, Any]] = {}  # pool -> the spec its replicas got (kept for resizes)
        self.spec: dict[str, Any] = {}
        self.threads = 0
        self.joined = False

    def start(self, progress: bool = True) -> None:
        import ray
        from ray import serve

        from runtime.fleet.hub import FleetHub
        from runtime.fleet.replica import HUB_NAME, NAMESPACE, EngineReplica

        a = self.args
        address = a.address or os.environ.get("RAY_ADDRESS") or None
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        # The most replicas this fleet may run (disaggregated: both pools, with the room
        # --max-replicas leaves for the console to grow them).
        total = (max(a.prefill_replicas + a.decode_replicas, a.max_replicas or 0) if disaggregated(a)
                 else (a.max_replicas or a.replicas))
        threads = a.threads_per_replica or (max(1, cores // max(1, total)) if not address else 0)
        env = {k: v for k, v in os.environ.items() if k.startswith(("PAGEDJAX_", "XLA_", "JAX_"))}
        self.joined = bool(address)
        if address:
            try:
                ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
            except ConnectionError as exc:
                raise RuntimeError(f"cannot join the Ray cluster at {address} ({exc}); with Ray's token "
                                   f"authentication set RAY_AUTH_TOKEN to the cluster's token, or use --address auto "
                                   f"on one of its nodes") from None
        else:
            ray.init(num_cpus=max(cores, total * max(threads, 1)), namespace=NAMESPACE,
                     include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env} if env else None)
            log.info("local Ray instance at %s (`ray status --address` it)", ray.get_runtime_context().gcs_address)
        self.hub = ray.remote(num_cpus=0)(FleetHub).options(name=HUB_NAME, namespace=NAMESPACE,
                                                             get_if_exists=True).remote()
        serve.start(proxy_location="Disabled")
        self.spec = {"checkpoint": str(self.checkpoint.resolve()), "engine_args": _engine_args(a),
                     "threads": threads, "warmup": not a.no_warmup, "kv_events_endpoint": a.kv_events_endpoint,
                     "kv_events_topic": a.kv_events_topic}
        self.threads = threads
        if disaggregated(a):
            self._start_pools(progress)
            return
        app = serve.deployment(EngineReplica, **deployment_options(a, threads)).bind(self.spec)
        log.info("starting %d replica(s) of %s (%s cores each)%s", a.replicas, self.checkpoint.name,
                 threads or "all", f" on {address}" if address else " on a local Ray instance")
        serve._run(app, _blocking=False, name=APP_NAME, route_prefix=None)
        self._wait_running(progress)
        self.handle = serve.get_deployment_handle(DEPLOYMENT, app_name=APP_NAME)

    def _start_pools(self, progress: bool) -> None:
        """Disaggregated: the prefill and decode pools, each its own application of the same
        replica class with its role in the spec (both start at once)."""
        from ray import serve

        a = self.args
        for pool in POOLS:
            self.pool_specs[pool] = {**self.spec, "role": pool, "transfer_timeout_s": a.kv_transfer_timeout,
                                     "reservation_lease_s": a.kv_reservation_lease,
                                     "rank_offset": a.prefill_replicas if pool == "decode" else 0}
            self._deploy_pool(pool)
        log.info("starting %d prefill and %d decode replica(s) of %s (%s cores each)", a.prefill_replicas,
                 a.decode_replicas, self.checkpoint.name, self.threads or "all")
        for pool in POOLS:
            self._wait_running(progress, app_name=f"{APP_NAME}-{pool}", deployment=pool)
            self.pools[pool] = serve.get_deployment_handle(pool, app_name=f"{APP_NAME}-{pool}")

    def _deploy_pool(self, pool: str) -> None:
        from ray import serve

        from runtime.fleet.replica import EngineReplica

        app = serve.deployment(EngineReplica, **deployment_options(self.args, self.threads, pool)).bind(
            self.pool_specs[pool])
        serve._run(app, _blocking=False, name=f"{APP_NAME}-{pool}", route_prefix=None)

    def resize_pools(self, sizes: dict[str, int]) -> None:
        """New pool sizes (the console): redeploy each changed pool with the same code and
        spec, so Ray Serve only adds or drains replicas (no restarts of the others). A
        replica added later pins cores after the pools' starting ranks."""
        a = self.args
        for pool in POOLS:
            attr = f"{pool}_replicas"
            if sizes[pool] != getattr(a, attr):
                setattr(a, attr, sizes[pool])
                self._deploy_pool(pool)

    def _wait_running(self, progress: bool, timeout_s: float = 1800.0, app_name: str = APP_NAME,
                      deployment: str = DEPLOYMENT) -> None:
        from ray import serve

        t0, last = time.monotonic(), None
        while time.monotonic() - t0 < timeout_s:
            app = serve.status().applications.get(app_name)
            if app is not None:
                dep = app.deployments.get(deployment)
                states = dict(dep.replica_states) if dep else {}
                line = ", ".join(f"{n} {str(k).lower()}" for k, n in sorted(states.items(), key=str))
                if line != last and line:
                    log.info("replicas: %s (%.0f s)", line, time.monotonic() - t0)
                    last = line
                status = str(app.status)
                if status.endswith("RUNNING"):
                    return
                if status.endswith("DEPLOY_FAILED") or (dep is not None and str(dep.status).endswith("UNHEALTHY")
                                                        and "failed" in (dep.message or "").lower()):
                    raise RuntimeError(f"a replica failed to start: {_one_line(RuntimeError(dep.message if dep else app.message))}")
            time.sleep(0.5)
        raise RuntimeError(f"replicas not running after {timeout_s:.0f} s")

    def autoscale_knobs(self) -> dict[str, Any] | None:
        if disaggregated(self.args):
            return None
        opts = deployment_options(self.args, self.threads)
        auto = opts.get("autoscaling_config")
        return dict(auto["policy"]["policy_kwargs"]) if auto else None

    def rescale(self, knobs: dict[str, Any]) -> None:
        """New autoscaler knobs: redeploy with the same code and spec, so Ray Serve updates
        the autoscaling config in place (no replica restarts)."""
        from ray import serve

        from runtime.fleet.replica import EngineReplica

        a = self.args
        a.min_replicas, a.max_replicas = knobs["min_replicas"], knobs["max_replicas"]
        a.scale_horizon, a.scale_in_delay = knobs["horizon_s"], knobs["scale_in_delay_s"]
        a.target_utilization = knobs["target_utilization"]
        a.replicas = max(a.min_replicas, min(a.max_replicas, a.replicas))
        opts = deployment_options(a, self.threads)
        if "autoscaling_config" in opts:
            opts["autoscaling_config"]["policy"]["policy_kwargs"].update(knobs)
            opts["autoscaling_config"].pop("initial_replicas", None)  # a start-up setting only
        serve._run(serve.deployment(EngineReplica, **opts).bind(self.spec), _blocking=False, name=APP_NAME,
                   route_prefix=None)

    def client(self, ecfg: Any, tokenizer: Any):
        from runtime.fleet.gateway import FleetClient

        a = self.args
        sc = ecfg.scheduler
        return FleetClient(self.handle, self.hub, tokenizer, ecfg.model.vocab_size, sc.max_model_len,
                           min(sc.max_model_len, ecfg.cache.num_tokens), ecfg.cache.block_size,
                           queue_cap=a.fleet_queue_cap, queue_timeout_s=a.fleet_queue_timeout, policy=ecfg.policy,
                           envelope=sc, autoscale=self.autoscale_knobs(), rescale=self.rescale,
                           route_at_gateway=a.router == "prefix", pools=self._pools())

    def _pools(self) -> Any:
        if not self.pools:
            return None
        from runtime.fleet.pools import Pools

        a = self.args
        sizes = {"prefill": a.prefill_replicas, "decode": a.decode_replicas}
        return Pools(dict(self.pools), sizes, max(sum(sizes.values()), a.max_replicas or 0), self.resize_pools)

    def shutdown(self) -> None:
        """A local instance goes entirely; on a cluster we joined only our application and hub
        go (other applications keep running), then we disconnect."""
        import ray
        from ray import serve

        if not ray.is_initialized():
            return
        try:
            if self.joined:
                for name in ([f"{APP_NAME}-{p}" for p in POOLS] if disaggregated(self.args) else [APP_NAME]):
                    serve.delete(name)
                if self.hub is not None:
                    ray.kill(self.hub)
            else:
                serve.shutdown()
        finally:
            ray.shutdown()


def _engine_args(a: argparse.Namespace) -> dict[str, Any]:
    from runtime.core.engine_args import engine_arg_names

    return {k: getattr(a, k) for k in engine_arg_names() if hasattr(a, k)}


def cmd_fleet_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from console.admin_cli import open_store
    from console.app import create_app
    from console.state import restore_policy
    from console.serve import GracefulServer, _configure_access_log, server_settings
    from runtime.checkpoint.pull import resolve_checkpoint
    from runtime.checkpoint.store import load_config
    from runtime.core.engine_args import engine_config_from_args
    from runtime.optional import require
    from runtime.tokenizer import TextTokenizer

    if args.kv_events_endpoint:
        require("pagedjax fleet serve --kv-events-endpoint", "zmq")
    path = resolve_checkpoint(args.checkpoint)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a pagedjax checkpoint (no config.json); see `pagedjax pull`")
    store = open_store(args)  # the API keys and their limits apply in front of the fleet too
    if disaggregated(args):
        # Fixed pools: the autoscaler sizes one colocated deployment, and the gateway pins
        # each disaggregated call to a replica through the prefix-aware router.
        if args.prefill_replicas < 1 or args.decode_replicas < 1:
            raise ValueError("--prefill-replicas/--decode-replicas: both must be at least 1 to disaggregate")
        if args.replicas is not None or args.min_replicas is not None:
            raise ValueError("--prefill-replicas/--decode-replicas: pools sized by those flags (and from the "
                             "console); leave out --replicas and --min-replicas")
        if args.max_replicas is not None and args.max_replicas < args.prefill_replicas + args.decode_replicas:
            raise ValueError(f"--max-replicas: {args.max_replicas} is fewer than the pools' "
                             f"{args.prefill_replicas + args.decode_replicas} replicas")
        if args.router != "prefix":
            raise ValueError("--prefill-replicas/--decode-replicas: need --router prefix")
        if getattr(args, "no_prefix_cache", False):
            raise ValueError("--prefill-replicas/--decode-replicas: need the prefix cache")
        if not args.kv_reservation_lease >= 0.5:  # the gateway renews every fifth of it
            raise ValueError(f"--kv-reservation-lease: {args.kv_reservation_lease} s is under the 0.5 s minimum")
        args.replicas = args.prefill_replicas + args.decode_replicas
    elif args.replicas is None:
        args.replicas = 2
    if args.replicas < 1:
        raise ValueError("--replicas: must be at least 1")
    cfg = load_config(path)
    ecfg = engine_config_from_args(args)(cfg)  # validates the engine flags here, not in every replica
    tok = TextTokenizer.from_checkpoint(path, cfg.bos_token_id, cfg.eos_token_ids, cfg.add_bos_token)
    settings = server_settings(args, path)
    _configure_access_log()
    fleet = Fleet(args, path)
    try:
        fleet.start(progress=sys.stderr.isatty())
    except Exception as exc:  # noqa: BLE001 -- one line, not Ray's traceback wall
        log.error("the fleet failed to start: %s", _one_line(exc), exc_info=args.verbose)
        fleet.shutdown()
        return 1
    client = fleet.client(ecfg, tok)
    client.start()
    if not client.wait_for_replicas(args.replicas, timeout_s=60):
        log.warning("only %d of %d replicas reported within 60 s; serving anyway", len(client.view.live()),
                    args.replicas)
    # The fleet-wide policy an operator last applied, on every replica before the first request.
    restore_policy(store, client, reset=settings.reset_policy,
                   apply=lambda who, changes: client.apply_policy(who, changes, None))
    app = create_app(settings, engine=client, fleet=True, store=store)
    app.state.fleet = fleet
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, access_log=False,
                            lifespan="on", timeout_graceful_shutdown=5, timeout_keep_alive=5)
    server = GracefulServer(config, app, settings.shutdown_grace_s)
    log.info("fleet serving %r on http://%s:%d with %s", settings.model_name, settings.host, settings.port,
             f"{args.prefill_replicas} prefill + {args.decode_replicas} decode replica(s)" if disaggregated(args)
             else f"{args.replicas} replica(s)")
    try:
        server.run()
    finally:
        # Replicas and the local Ray instance go with the gateway (bounded: a wedged Ray
        # must not keep the process alive; its atexit hook still cleans up).
        t = threading.Thread(target=fleet.shutdown, daemon=True)
        t.start()
        t.join(timeout=30)
    return server.exit_code
