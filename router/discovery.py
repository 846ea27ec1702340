"""Which instances the proxy routes to, and each one's KV-event feed.

Instances come from the command line (static), an instances file (watched every health interval), Kubernetes pod
discovery, and the admin API. Adding one registers it (health, KV geometry) and, when it publishes KV events,
subscribes the prefix index to them and waits briefly for the replay of what it already caches, so a (re)started
proxy routes on a warm index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

from vllm_disagg.router.config import InstanceConfig, read_instances_file
from vllm_disagg.router.instances import Instance

if TYPE_CHECKING:
    from vllm_disagg.router.app import Proxy

logger = logging.getLogger("vllm_disagg.proxy")


class Discovery:
    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.subscribers: dict[str, Any] = {}
        self._file_mtime = 0.0
        self._k8s: Any = None

    async def start(self) -> list[asyncio.Task[None]]:
        """Register the static and file instances; start Kubernetes discovery (its task is returned)."""
        settings = self.proxy.settings
        for cfg in settings.instances:
            await self.add(cfg)
        if settings.instances_file:
            await self.sync_file()
        if not settings.k8s_namespace:
            return []
        from vllm_disagg.router.k8s_discovery import KubernetesDiscovery

        async def on_remove(instance_id: str) -> None:
            if instance_id in self.proxy.registry.instances:
                self.remove(instance_id)

        async def on_add(cfg: InstanceConfig) -> None:
            if cfg.instance_id() not in self.proxy.registry.instances:
                await self.add(cfg)

        self._k8s = KubernetesDiscovery(settings.k8s_namespace, settings.k8s_selector, on_add, on_remove)
        return [asyncio.create_task(self._k8s.run())]

    def stop(self) -> None:
        for sub in self.subscribers.values():
            with contextlib.suppress(Exception):
                sub.stop()

    async def add(self, cfg: InstanceConfig) -> Instance:
        proxy = self.proxy
        inst = await proxy.registry.add(cfg)
        index = proxy.index
        if index is not None:
            if cfg.kv_events:
                from vllm_disagg.router.kv_events import KVEventSubscriber

                # known to the index before its first event (a catch-up that starts with a gap counts as a reset)
                index.set_precise(inst.id, True)
                sub = KVEventSubscriber(index, inst.id, cfg.kv_events, replay_endpoint=cfg.kv_events_replay)
                sub.start()
                self.subscribers[inst.id] = sub
                # A (re)started proxy replays what the instance already caches before routing to it; an instance
                # that does not answer the replay costs at most this wait (its live events still arrive).
                await asyncio.to_thread(sub.wait_caught_up, 2.0)
            else:
                index.set_precise(inst.id, False)
        return inst

    def remove(self, instance_id: str) -> Instance:
        """Take the instance out of routing and drop everything kept for it: its metric series, idle connections,
        KV-event subscriber, prefix-index entries and the policy's per-instance state."""
        proxy = self.proxy
        inst = proxy.registry.remove(instance_id)
        sub = self.subscribers.pop(instance_id, None)
        if sub is not None:
            sub.stop()
        proxy.forget_instance(inst)
        return inst

    async def sync_file(self) -> None:
        """File discovery: add what appeared, remove what disappeared (checked every health interval)."""
        settings = self.proxy.settings
        path = settings.instances_file
        if not path:
            return
        try:
            mtime = os.stat(path).st_mtime
            if mtime == self._file_mtime:
                return
            wanted = {c.instance_id(): c for c in read_instances_file(path)}
            self._file_mtime = mtime
        except Exception as exc:
            logger.error("instances file %s unreadable: %s (keeping the current instances)", path, exc)
            return
        static = {c.instance_id() for c in settings.instances}
        registry = self.proxy.registry
        for iid in list(registry.instances):
            if iid not in wanted and iid not in static:
                self.remove(iid)
                logger.info("instance %s removed (no longer in %s)", iid, path)
        for iid, cfg in wanted.items():
            if iid not in registry.instances:
                await self.add(cfg)
