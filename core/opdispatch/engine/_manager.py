"""OpManager: loads plugins once, probes devices, applies the policy, caches and explains decisions."""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import pluggy

from opdispatch.plugins import hookspec as _hookspec
from opdispatch.plugins._loader import (PluginRecord, check_hooks, check_plugin_api, load_entry_point_plugins,
                                         plugin_namespaces)

from ..base._decision import (CHOSEN, DEMOTED, DENIED, ELIGIBLE, FAILED, REJECTED, UNAVAILABLE, Candidate, Decision,
                              NoImplementationError, PinnedImplementationError, Provenance)
from opdispatch.policies._overrides import OVERRIDES

from ..base import _native
from ._breaker import CLASS, Breaker, RetryDue, may_fail_over
from ._output_guard import ImplementationOutputError, check_values_enabled, guarded, structure_problems
from ._profiling import profiling, ranged
from ._shadow import Shadow, shadow_from_environ
from ._classes import DecisionClasses
from ..base._device import DeviceInfo, probe_cpu, probe_generic
from ._graphs import is_capturing, raise_if_capturing
from ..base._errors import OpDispatchError, RegistrationError
from ..base._impl import Impl, _template
from ._registry import Origin, Registry
from . import _state
from ._state import CACHE_LIMIT, DispatchState, bounded_put
from ._stats import UsageCounters, register_exit_summary
from ._decisions_lock import DecisionLock, lock_from_environ

log = logging.getLogger("opdispatch")


def _is_compiling() -> bool:
    import torch

    return bool(torch.compiler.is_compiling())

ENV_LOG_LEVEL = "OPDISPATCH_LOG_LEVEL"
__all__ = ["CACHE_LIMIT", "OpManager"]


def _configure_logging() -> None:
    level = os.environ.get(ENV_LOG_LEVEL)
    if not level:
        return
    value = logging.getLevelName(level.strip().upper())
    if not isinstance(value, int):
        raise ValueError(f"{ENV_LOG_LEVEL}={level!r} is not a logging level; use DEBUG, INFO, WARNING or ERROR")
    log.setLevel(value)
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("opdispatch %(levelname)s: %(message)s"))
        log.addHandler(handler)


class OpManager:
    """Holds the registry of implementations per op and decides which one takes each call.

    Initialisation is lazy (plugins load on first use) and happens once per process; a forked child keeps the
    loaded plugins but forgets device probes and cached decisions, which may not hold across a fork. The policy,
    the implementations configured with its options and every cache live in one `DispatchState`, replaced whole.
    """

    def __init__(self, *, load_entry_points: bool = True, entry_points: Iterable[Any] | None = None,
                 policy: Any = None, environ: dict[str, str] | None = None) -> None:
        from opdispatch.policies._policy import Policy

        self._load_entry_points = load_entry_points
        self._entry_points = entry_points
        self._environ = environ
        self._lock = threading.RLock()
        self._initialized = False
        self.registry = Registry()
        self.plugins: list[PluginRecord] = []
        self._pm = pluggy.PluginManager(_hookspec.PROJECT_NAME)
        self._pm.add_hookspecs(_hookspec)
        self._state: DispatchState | None = None  # swapped whole (`_install`), never changed in place
        # The state's per-call fast path and checked varlen signatures, kept as attributes of their own so the
        # front doors reach them with one attribute read; `_install` replaces them together with the state.
        self.fast: dict[Any, Any] = {}
        self.checked_varlen: dict[Any, bool] = {}
        # Size-generic templates (opdispatch.doors._api): a fast-path key with its sizes left out -> a validated call,
        # its decision and bound function, for calls that differ from it only in sizes.
        self.size_generic: dict[Any, Any] = {}
        # How many decisions were made (cache misses of `resolve`): a decode loop should make one.
        self.decisions_made = 0
        # Implementations demoted per call signature, then per call class, after raising at run time
        # (settings.fallback_on_error); its `clock` is the time every demotion and retry is measured in.
        self.breaker = Breaker()
        # Usage counters (`opdispatch.stats()`) and the replayed decision lockfile (OPDISPATCH_DECISIONS, read
        # when plugins load), both touched only where a decision or a slow-path call happens.
        self.usage = UsageCounters()
        self.lock: DecisionLock | None = None
        self._check_values: bool | None = None  # OPDISPATCH_CHECK_OUTPUTS, read on first use
        # OPDISPATCH_SHADOW (`_shadow`), read on first use: None while unread or off.
        self._shadow: Shadow | None = None
        self._shadow_read = False
        # Quarantine files added to every policy this manager installs (`add_quarantine`: a shadow check's).
        self._added_quarantines: list[str] = []
        self._devices: dict[Any, DeviceInfo] = {}
        self._policy_object: Any = policy if isinstance(policy, Policy) else None
        self._policy_path: Any = None if isinstance(policy, Policy) else policy
        # Agreement of new decisions across a torch.distributed group (`opdispatch.distributed.consistent()`,
        # OPDISPATCH_DISTRIBUTED); None: this process decides alone.
        from ._agreement import from_environ

        self.agreement: Any = from_environ(self.environ)
        _MANAGERS.add(self)

    # -- initialisation --------------------------------------------------------------------------------------
    @property
    def environ(self) -> Any:
        return os.environ if self._environ is None else self._environ

    def ensure_initialized(self) -> None:
        if self._initialized:
            return
        with self._lock:
            if self._initialized:
                return
            _configure_logging()
            register_exit_summary(self.environ, self)
            self.shadow  # OPDISPATCH_SHADOW checked here: a bad value is a setting's error, not a kernel's
            self.lock = lock_from_environ(self.environ)
            if self._load_entry_points:
                records = load_entry_point_plugins(self._pm, self._entry_points, self.environ)
                self.plugins.extend(records)
                for record in records:
                    if record.status == "loaded":
                        self._collect_impls(record)
            self._initialized = True

    def _collect_impls(self, record: PluginRecord) -> None:
        """Call one plugin's `opdispatch_impls` hook (through pluggy, for this plugin alone) and register all it
        returns, or nothing: an id outside the plugin's namespaces, in a built-in vendor's namespace (for a
        third-party plugin) or refused by the registry fails the whole plugin."""
        plugin = self._pm.get_plugin(record.name)
        others = [p for p in self._pm.get_plugins() if p is not plugin]
        try:
            results = self._pm.subset_hook_caller("opdispatch_impls", remove_plugins=others)()
            module = getattr(plugin, "__name__", type(plugin).__module__)
            impls: list[Impl] = [impl for result in results if result is not None for impl in result]
            reserved = {ns: r.name for r in self.plugins if r.builtin and r is not record for ns in r.namespaces}
            for impl in impls:
                vendor = getattr(impl, "vendor", None)
                if vendor not in record.namespaces:
                    raise RegistrationError(
                        f"plugin {record.name!r} registered {getattr(impl, 'id', impl)!r}, outside its namespaces "
                        f"{', '.join(record.namespaces)}; a plugin's ids start with its entry-point name, or with a "
                        "name its module lists in OPDISPATCH_NAMESPACES (plugins/opdispatch/plugins/hookspec.py)",
                        impl=impl)
                if not record.builtin and vendor in reserved:
                    raise RegistrationError(
                        f"plugin {record.name!r} registered {impl.id!r}, but {vendor!r} is the namespace of the "
                        f"built-in plugin {reserved[vendor]!r}: a third-party plugin cannot register or displace a "
                        "built-in vendor's implementations; use your own vendor name", impl=impl)
            self.registry.register_all([(impl, Origin(record.name, type(impl).__module__ or module))
                                        for impl in impls])
            record.impl_ids.extend(impl.id for impl in impls)
        except Exception as exc:  # keep the others working; doctor and explain show this
            record.fail("register", exc)
            log.warning("%s", record.describe())
            self._drop_from_pluggy(plugin)

    def _drop_from_pluggy(self, plugin: Any) -> None:
        """A plugin that failed to load or register leaves pluggy too: none of its other hooks (a device probe)
        runs, and its name is free for a corrected plugin."""
        if plugin is not None and self._pm.is_registered(plugin):
            self._pm.unregister(plugin)

    def register_plugin(self, plugin: Any, name: str) -> PluginRecord:
        """Register an in-memory plugin object (anything with ``@opdispatch.hookimpl`` functions), by the same
        rules as an entry point named `name`."""
        self.ensure_initialized()
        with self._lock:
            record = PluginRecord(name=name, value=getattr(plugin, "__name__", repr(plugin)))
            self.plugins.append(record)
            try:
                check_plugin_api(plugin, name)
                record.namespaces = plugin_namespaces(plugin, name)
                self._pm.register(plugin, name=name)
                check_hooks(self._pm, plugin, name)
            except Exception as exc:
                record.fail("load", exc)
                log.warning("%s", record.describe())
                self._drop_from_pluggy(plugin)
                return record
            self._collect_impls(record)
            self.clear_cache()
            return record

    def register_impl(self, impl: Impl, plugin: str = "(registered in code)") -> None:
        """Register one implementation directly (tests, notebooks); plugins are the normal route."""
        self.ensure_initialized()
        self.registry.register(impl, Origin(plugin, type(impl).__module__))
        self.clear_cache()

    def clear_cache(self) -> None:
        """Forget decisions and availability answers (after a plugin or environment change): a new state for the
        installed policy."""
        with self._lock:
            if self._state is not None:
                self._install(self._state.policy)
            else:
                _invalidate_compiled()

    # -- policy ----------------------------------------------------------------------------------------------
    @property
    def state(self) -> DispatchState:
        """The installed policy with its configured implementations and caches (built on first use)."""
        current = self._state
        if current is None:
            with self._lock:
                if self._state is None:
                    self._install(self._load_policy())
                current = self._state
            assert current is not None
        return current

    @property
    def policy(self) -> Any:
        return self.state.policy

    def _load_policy(self) -> Any:
        from opdispatch.policies._policy import load_policy
        from opdispatch.policies._policy import EnvOverrides

        if self._policy_object is not None:
            policy = self._policy_object.with_env(EnvOverrides.from_environ(self.environ))
        else:
            policy = load_policy(self._policy_path, environ=self.environ)
        return self._with_added_quarantines(policy)

    def _with_added_quarantines(self, policy: Any) -> Any:
        """`policy` with the quarantine files of `add_quarantine` read anew, each replacing a layer read from the
        same file (e.g. OPDISPATCH_QUARANTINE's)."""
        if not self._added_quarantines:
            return policy
        from opdispatch.policies._policy import Policy
        from opdispatch.policies._policy import read_quarantine_file

        from ..base._errors import PolicyError

        layers = [layer for layer in policy.layers if layer.source not in self._added_quarantines]
        for path in self._added_quarantines:
            try:
                layers.append(read_quarantine_file(path))
            except (PolicyError, OSError) as exc:  # like any quarantine: a broken one is reported and skipped
                log.warning("quarantine file skipped: %s", exc)
        return Policy(layers, policy.env)

    def add_quarantine(self, path: Any) -> None:
        """Read the quarantine file `path` into the installed policy, now and at every later `reload` or
        `set_policy` of this manager (a shadow check that quarantined a class: `_shadow`). Decisions are made
        afresh, as after a reload."""
        with self._lock:
            if str(path) not in self._added_quarantines:
                self._added_quarantines.append(str(path))
            self._install(self._with_added_quarantines(self.state.policy))

    def _install(self, policy: Any) -> None:
        """Build the state for `policy` (validating its options and ids: an error leaves the old state in place),
        then swap it in."""
        self.ensure_initialized()
        with self._lock:
            state = DispatchState.build(policy, self.registry, lambda: _failed_plugins_text(self.plugins))
            self._use(state)
        _invalidate_compiled()

    def _use(self, state: DispatchState) -> None:
        # The state is one reference: readers see the old one or the new one, never a mix. The fast-path aliases
        # follow it; a reader pairing a new alias with the old state sees only fresh entries, which carry their
        # own decisions.
        self._state = state
        self.fast = state.fast
        self.checked_varlen = state.checked_varlen
        self.size_generic = state.size_generic
        _native.forget()  # the compiled front doors' entries point into the old state's cache

    def set_policy(self, policy: Any) -> None:
        """Use `policy` (a Policy object, or the path of a YAML file) from now on; cached decisions are dropped.

        A path is re-read by `reload()`; a Policy object is kept (reload re-reads only the env vars over it).
        """
        from opdispatch.policies._policy import Policy

        if isinstance(policy, Policy):
            self._policy_object, self._policy_path = policy, None
        else:
            self._policy_object, self._policy_path = None, policy
        self._install(self._load_policy())

    def reload(self) -> None:
        """Re-read the policy file and the OPDISPATCH_* env vars, and swap them in atomically.

        The policy hash is part of every decision's cache key, so no decision made before survives.
        """
        self._install(self._load_policy())

    # -- devices ---------------------------------------------------------------------------------------------
    def device_info(self, device: Any) -> DeviceInfo:
        """Describe a torch device (probed once per process) — plugins first, then opdispatch's own probes."""
        info = self._devices.get(device)
        if info is not None:
            return info
        self.ensure_initialized()
        import torch

        dev = torch.device(device)
        if dev.type == "cpu":
            info = probe_cpu()
        else:
            info = self._probe_with_plugins(dev) or probe_generic(dev)
        self._devices[device] = info
        return info

    def _probe_with_plugins(self, dev: Any) -> DeviceInfo | None:
        """`opdispatch_probe_device` through pluggy, in pluggy's call order, each plugin's hook called alone so
        that one raising is recorded and skipped (the first non-None answer wins: the hook's firstresult)."""
        hook = self._pm.hook.opdispatch_probe_device
        for hook_impl in reversed(hook.get_hookimpls()):
            others = [p for p in self._pm.get_plugins() if p is not hook_impl.plugin]
            try:
                result = self._pm.subset_hook_caller("opdispatch_probe_device", remove_plugins=others)(device=dev)
            except Exception as exc:
                for record in self.plugins:
                    if record.name == hook_impl.plugin_name:
                        record.fail("probe", exc)
                log.warning("plugin %r failed to probe %s: %s", hook_impl.plugin_name, dev, exc)
                continue
            if result is not None:
                return result  # type: ignore[no-any-return]  # a DeviceInfo, by the hook's contract
        return None

    def availability(self, impl: Impl, device: DeviceInfo, state: DispatchState | None = None) -> str | None:
        """Why `impl` cannot run on `device` (None if it can), cached in the state: it may depend on options."""
        cache = (state or self.state).availability
        key = (impl.id, device.key)
        try:
            return cache[key]
        except KeyError:
            pass
        try:
            reason = impl.availability(device)
        except Exception as exc:  # an availability check must never take dispatch down
            reason = f"availability check raised {type(exc).__name__}: {exc}"
        bounded_put(cache, key, reason)
        return reason

    def implementations(self, op: str) -> list[Impl]:
        """The implementations of `op`, configured with the installed policy's options, in registry order."""
        return list(self.state.impls.get(op, {}).values())

    def implementation(self, op: str, impl_id: str) -> Impl | None:
        """One implementation of `op` as the installed policy configures it, or None if not registered."""
        return self.state.implementation(op, impl_id)

    # -- deciding --------------------------------------------------------------------------------------------
    def resolve(self, op: str, call: Any, *, device: DeviceInfo | None = None, impl: str | None = None,
                use_cache: bool = True) -> Decision:
        """Decide which implementation takes `call`; raise NoImplementationError if none can."""
        if impl is not None and not isinstance(impl, str):
            raise TypeError(f"{op}: impl={impl!r} ({type(impl).__name__}); it must be one implementation id string "
                            "such as 'cpu.flash', or None to let the policy choose (see `opdispatch list`)")
        if device is None:
            device = self.device_info(call.device)
        state = self.state
        overrides = OVERRIDES.get()
        cache = state.decisions
        key = self._cache_key(op, call, device, impl, overrides, state)
        signature, lookup = self._signature_scope(key, call)
        if use_cache:
            decision = cache.get(lookup)
            # Under group agreement a decision this rank made alone (before agreement, inside `local()`) is decided
            # again, collectively: every rank of the group then takes part.
            if decision is not None and (decision.retry_at is None or self.breaker.clock() < decision.retry_at) and (
                    self.agreement is None or decision.agreed or not self.agreement.ready()):
                # Least recently used goes first: a hit moves to the end (where a run of one class has it) — once
                # the cache is half full, where eviction is near. Below that a hit leaves the dict alone: the
                # compiled door's size-generic entries watch it, and a model's layers (a class each, by module)
                # taking turns would otherwise change it at every call and keep every entry stale (h100-ee86431:
                # generate() never reached them).
                try:
                    if len(cache) > _state.CACHE_LIMIT // 2 and next(reversed(cache.values())) is not decision:
                        cache[lookup] = cache.pop(lookup)
                except (KeyError, StopIteration, RuntimeError):  # changed by another thread: still valid
                    pass
                return decision  # type: ignore[no-any-return]
        raise_if_capturing(op, call)  # deciding probes devices and may sync: never inside CUDA graph capture
        agreement = self.agreement
        if agreement is None:
            decision = self._decide(op, call, device, impl, state, overrides, key, signature)
        else:  # every rank of the group takes part, also one that cannot decide (its error is re-raised after)
            try:
                decision = self._decide(op, call, device, impl, state, overrides, key, signature)
            except OpDispatchError as exc:
                agreement.agree_failed(self, op, call, exc)
                raise
            decision = agreement.agree(self, op, call, decision)
        self.decisions_made += 1
        if decision.chosen is None:
            raise _no_impl_error(decision, self.plugins)
        self.usage.decided(decision)
        if use_cache:
            bounded_put(cache, lookup, decision)
        log.info("%s: chose %s for [%s] on %s (decided by %s)", op, decision.chosen_id, decision.call,
                 device.describe(), decision.decided_by)
        if getattr(decision.chosen, "reference_fallback", False) and device.type != "cpu":
            self._warn_reference(decision, key, state)
        if log.isEnabledFor(logging.DEBUG):
            for c in decision.candidates:
                log.debug("  %s: %s%s", c.impl_id, c.status, (" — " + "; ".join(c.reasons)) if c.reasons else "")
        return decision

    def cached_decision(self, op: str, call: Any, *, impl: str | None = None) -> Decision | None:
        """The cached decision for `call`'s class, or None; never decides (safe during CUDA graph capture)."""
        state = self.state
        device = self.device_info(call.device)
        _, lookup = self._signature_scope(self._cache_key(op, call, device, impl, OVERRIDES.get(), state), call)
        decision: Decision | None = state.decisions.get(lookup)
        return decision

    def _signature_scope(self, key: Any, call: Any) -> tuple[Any, Any]:
        """`call`'s signature when the breaker demoted an implementation for one signature of its class (else
        None), and the decision cache key to look up: the class's, or — while such a demotion holds for this very
        signature — one of the signature's own (other signatures of the class keep the class's decision)."""
        breaker = self.breaker
        if not breaker or not breaker.has_signature_demotions(key):
            return None, key
        signature = call.signature()
        if breaker.holds_for_signature(key, signature, breaker.clock()):
            return signature, ("signature", key, signature)
        return signature, key

    def _cache_key(self, op: str, call: Any, device: DeviceInfo, impl: str | None, overrides: Any,
                   state: DispatchState) -> tuple[Any, ...]:
        """What a cached decision stands for: the call's class on this device, the pin, the overrides (the state
        is the policy: each state has its own cache)."""
        return (op, self.decision_class(op, call, state, device), device.key, impl, overrides)

    def decision_class(self, op: str, call: Any, state: DispatchState | None = None,
                       device: DeviceInfo | None = None) -> Any:
        """The class of `call` under the active policy: calls of one class share one decision (see _classes)."""
        state = state if state is not None else self.state
        device = device if device is not None else self.device_info(call.device)
        classes = state.classes.get(op)
        if classes is None:
            classes = state.classes[op] = DecisionClasses(op, state.policy, list(state.impls.get(op, {}).values()))
        keyed = classes.keyed_on.get(device.key)
        if keyed is None:  # an implementation unavailable on this device never reads the call
            keyed = classes.keyed_on[device.key] = [
                i for i in classes.keyed if self.availability(i, device, state) is None]
        return classes.key(call, keyed)

    def _warn_reference(self, decision: Decision, key: Any, state: DispatchState) -> None:
        """Once per decision class: a reference implementation took a call on an accelerator (an O(S^2) cliff)."""
        if key in state.warned_reference:
            return
        bounded_put(state.warned_reference, key, None)
        others = [c for c in decision.candidates if c.impl_id != decision.chosen_id and c.status != UNAVAILABLE
                  and not c.impl_id.startswith("plugin:")]
        why = "; ".join(f"{c.impl_id}: {c.status}" + (f" ({'; '.join(c.reasons)})" if c.reasons else "")
                        for c in others) or "no other implementation is available on this device"
        log.warning("%s: %s (slow, unfused) takes [%s] on %s because no fused implementation can: %s. Run "
                    "`opdispatch explain` for the full table.", decision.op, decision.chosen_id, decision.call,
                    decision.device.describe(), why)

    def explain(self, op: str, call: Any, *, device: DeviceInfo | None = None, impl: str | None = None) -> Decision:
        """Like `resolve`, but never raises for lack of an implementation: the Decision says why."""
        if device is None:
            device = self.device_info(call.device)
        state, overrides = self.state, OVERRIDES.get()
        key = self._cache_key(op, call, device, impl, overrides, state) if self.breaker else None
        signature = None if key is None else self._signature_scope(key, call)[0]
        decision = self._decide(op, call, device, impl, state, overrides, key, signature)
        if self.agreement is not None:
            from ._agreement import explained

            agreed = state.decisions.get(key if key is not None else self._cache_key(op, call, device, impl,
                                                                                      overrides, state))
            explained(self, decision, agreed)
        return decision

    def _decide(self, op: str, call: Any, device: DeviceInfo, impl: str | None, state: DispatchState,
                overrides: Any, key: Any = None, signature: Any = None) -> Decision:
        """Decide `call` (its class `key` for the breaker's demotions; with `signature`, also the demotions of
        that signature alone — the decision then stands for that signature only)."""
        self.ensure_initialized()
        policy = state.policy
        now = self.breaker.clock()
        retry_at: list[float] = []
        # The state's implementations (registered when it was built), so a plugin registering meanwhile cannot
        # make this decision see an implementation its state has not configured.
        impls = state.impls.get(op, {})
        origins = {r.impl.id: str(r.origin) for r in self.registry.for_op(op)}
        candidates: list[Candidate] = []
        chosen: Impl | None = None
        decided_by: Provenance | None = None

        def evaluate(impl_obj: Impl, prov: Provenance) -> Candidate:
            reason = self.availability(impl_obj, device, state)
            if reason is not None:
                return Candidate(impl_obj.id, UNAVAILABLE, [reason], prov, origins[impl_obj.id])
            try:
                reasons = list(impl_obj.not_supported_reasons(call, device))
            except Exception as exc:
                reasons = [f"not_supported_reasons raised {type(exc).__name__}: {exc}"]
            return Candidate(impl_obj.id, REJECTED if reasons else ELIGIBLE, reasons, prov, origins[impl_obj.id])

        def demoted(cand: Candidate) -> Candidate:
            """An eligible candidate the breaker demoted for this class or this signature (never a pinned one: a
            pin never falls back) — with the error it raised, the call, the scope and when it is retried."""
            consult = key is not None and self.breaker and policy.settings.fallback_on_error  # off: never demoted
            demotion = self.breaker.active(key, signature, cand.impl_id, now) if consult else None
            if cand.status == ELIGIBLE and demotion is not None:
                cand.status, cand.reasons = DEMOTED, [demotion.reason(now)]
                if demotion.retry_at is not None:
                    retry_at.append(demotion.retry_at)
            return cand

        plan = policy.plan(op, list(impls), call, device, overrides, impl=impl)
        if plan.pin is not None:
            pin_id, prov = plan.pin
            target = impls.get(pin_id)
            if target is None:
                decision = Decision(op, call.describe(), device, None, [], prov, policy.source, policy.hash, pin_id)
                raise _unknown_pin_error(op, pin_id, prov, sorted(impls), self.plugins, decision)
            cand = evaluate(target, prov)
            candidates.append(cand)
            for other_id in impls:
                if other_id != pin_id:
                    candidates.append(Candidate(other_id, DENIED, [f"pinned to {pin_id} by {prov}"],
                                                prov, origins[other_id]))
            candidates.extend(self._failed_candidates())
            decision = Decision(op, call.describe(), device, None, candidates, prov, policy.source, policy.hash,
                                pin_id, cache_key=key)
            if cand.status != ELIGIBLE:
                raise PinnedImplementationError(
                    f"{op}: implementation {pin_id!r} pinned by {prov} cannot take this call and a pin never "
                    f"falls back. It is {cand.status}: {'; '.join(cand.reasons)}.\n"
                    f"call: {decision.call}\ndevice: {device.describe()}\n"
                    f"Fix: pin another implementation (see `opdispatch explain`), or remove the pin to let the "
                    f"policy choose.", decision=decision)
            cand.status = CHOSEN
            decision.chosen = target
            return decision

        for impl_id, prov in plan.order:
            cand = demoted(evaluate(impls[impl_id], prov))
            if cand.status == ELIGIBLE and chosen is None:
                cand.status = CHOSEN
                chosen = impls[impl_id]
                decided_by = prov
            candidates.append(cand)
        for impl_id, prov in plan.denied.items():
            reason = (f"quarantined by validate: {prov.note} ({prov.source})" if prov.kind == "quarantine"
                      else f"denied by {prov}")
            candidates.append(Candidate(impl_id, DENIED, [reason], prov, origins[impl_id]))
        candidates.extend(self._failed_candidates())
        if self.lock is not None:  # OPDISPATCH_DECISIONS: the recorded choice, where it can take the call
            class_key = key if key is not None else self._cache_key(op, call, device, impl, overrides, state)
            chosen, decided_by = self.lock.steer(self, state, op, class_key, device, candidates, impls, chosen,
                                                 decided_by)
        # A decision that honours a demotion of this signature alone stands for this signature only.
        own = signature if any(c.status == DEMOTED for c in candidates) and signature is not None and \
            self.breaker.holds_for_signature(key, signature, now) else None
        return Decision(op, call.describe(), device, chosen, candidates, decided_by, policy.source, policy.hash,
                        cache_key=key, retry_at=min(retry_at, default=None), signature=own)

    def _failed_candidates(self) -> list[Candidate]:
        return [Candidate(f"plugin:{r.name}", FAILED, [r.describe()], None, r.origin)
                for r in self.plugins if r.status == "failed"]

    # -- running ---------------------------------------------------------------------------------------------
    def bind(self, op: str, call: Any, *, impl: str | None = None, guarded: bool = True) -> Any:
        """A function bound to the implementation chosen for `call`'s signature, taking the tensors the op's call
        record names in its `with_tensors` (attention: q, k, v). It does no lookup per call.

        `guarded` (plans): with settings.fallback_on_error, a kernel that raises is demoted (see `_breaker`) and
        the function re-binds itself to the next implementation. The front doors bind unguarded: their generated
        code hands a failure to `fail_over` itself, at no cost per call.
        """
        decision = self.resolve(op, call, impl=impl)
        while True:
            try:
                fn = self._bound(decision, call)
                break
            except Exception as exc:  # a kernel that cannot bind fails over like one that raises
                if not self.may_fail_over(decision, impl, exc, call.device):
                    raise
                decision = self._next_decision(op, call, impl, decision, exc)
        if not guarded or not self.policy.settings.fallback_on_error:
            return fn
        current = [fn]
        device, rebuild = call.device, _template(call).with_tensors  # no tensor of `call` kept

        def with_fallback(*tensors: Any) -> Any:
            try:
                return current[0](*tensors)
            except Exception as exc:
                if not isinstance(exc, RetryDue) and not self.may_fail_over(current[0].decision, impl, exc, device):
                    raise
                retry = rebuild(*tensors)
                if not isinstance(exc, RetryDue):
                    self.fail_over(current[0].decision, exc, bound=current[0])
                return self.run_bound(op, retry, impl, tensors, remember=lambda bound: current.__setitem__(0, bound))

        with_fallback.decision = decision  # type: ignore[attr-defined]
        return with_fallback

    def _bound(self, decision: Decision, call: Any) -> Any:
        """`decision.chosen` bound to `call`'s signature, with `.decision`, `.signature` (the call's) and
        `.described` (the call, for the breaker's messages); while the decision honours a demotion, the function
        raises RetryDue once the demoted kernel's retry is due. Raises what the implementation's `bind` raises."""
        chosen = decision.chosen
        assert chosen is not None
        fn = chosen.bound_function(chosen.conform(call))
        # Whether the function may serve calls of other sizes of this decision (`_attention.size_generic`): the
        # implementation's declaration, kept only through the wrappers below that hold nothing of `call`.
        generic = getattr(fn, "size_generic", False) is True
        conformer = chosen.input_conformer(call)
        if conformer is not None:  # inputs the kernel cannot read as they are (e.g. strides): conformed per call
            bound_kernel = fn

            def conforming(*tensors: Any) -> Any:
                return bound_kernel(*conformer(*tensors))

            fn = conforming
        fix = _result_fix(decision.op, chosen, call)
        if fix is not None:  # e.g. a returned LSE's gradient the kernel does not give (OpSpec.result_fix)
            unfixed, rebuild = fn, _template(call).with_tensors

            def fixed(*tensors: Any) -> Any:
                return fix(unfixed(*tensors), rebuild(*tensors))

            fn, generic = fixed, False
        if self.check_values:
            fn = guarded(decision.op, chosen.id, fn, _template(call).with_tensors, _bound_names(decision.op))
            generic = False
        shadow = self.shadow
        if shadow is not None and not getattr(chosen, "reference_fallback", False):  # bound only while it is on
            fn, generic = shadow.wrap(fn, decision, _template(call).with_tensors), False
        retry_at = decision.retry_at
        if retry_at is not None:
            kernel, clock = fn, self.breaker.clock

            def until_retry(*tensors: Any) -> Any:
                if clock() >= retry_at:
                    raise RetryDue
                return kernel(*tensors)

            fn = until_retry
        if getattr(chosen, "reference_fallback", False) and decision.device.type != "cpu":
            uncounted, usage = fn, self.usage

            def reference_counted(*tensors: Any) -> Any:  # every reference call on an accelerator is counted
                out = uncounted(*tensors)
                usage.reference_hit(decision)
                return out

            fn = reference_counted
        described = call.describe()
        if profiling():  # bound while a profiler records: the fast-path key says so, so only used then
            fn, generic = ranged(fn, decision.op, chosen.id, described), False
        fn.size_generic = generic  # type: ignore[attr-defined]
        fn.decision = decision  # type: ignore[attr-defined]
        fn.signature = call.signature()  # type: ignore[attr-defined]
        fn.described = described  # type: ignore[attr-defined]
        return fn

    @property
    def check_values(self) -> bool:
        """OPDISPATCH_CHECK_OUTPUTS: check every result's values and the inputs (see `_output_guard`)."""
        if self._check_values is None:
            self._check_values = check_values_enabled(self.environ)
        return self._check_values

    @property
    def shadow(self) -> Shadow | None:
        """OPDISPATCH_SHADOW's checker (see `_shadow`), or None when off; the env vars are read on first use (a
        bad value raises then)."""
        if not self._shadow_read:
            self._shadow = shadow_from_environ(self, self.environ)
            self._shadow_read = True
        return self._shadow

    def call(self, op: str, call: Any, *, impl: str | None = None) -> Any:
        """Decide and run `call`, checking the result's structure (failing over as `run_bound` does)."""
        decision = self.resolve(op, call, impl=impl)
        while True:
            chosen = decision.chosen
            assert chosen is not None
            try:
                if self.check_values:  # every tensor the call holds: checked unchanged, and for NaN given
                    names = _tensor_names(op, call)
                    result = guarded(op, chosen.id, lambda *_: chosen.run(chosen.conform(call)), lambda *_: call,
                                     names)(*(getattr(call, n) for n in names))
                elif profiling():
                    result = ranged(chosen.run, op, chosen.id, call.describe())(chosen.conform(call))
                else:
                    result = chosen.run(chosen.conform(call))
                _raise_for_structure(op, chosen.id, call, result)
            except Exception as exc:
                if not self.may_fail_over(decision, impl, exc, call.device):
                    raise
                decision = self._next_decision(op, call, impl, decision, exc)
                continue
            fix = _result_fix(op, chosen, call)  # after the kernel's own outcome: never a reason to demote it
            self.usage.called(decision)
            if fix is not None:
                result = fix(result, call)
            shadow = self.shadow
            if shadow is not None and not getattr(chosen, "reference_fallback", False):
                shadow.offer(decision, call, None, result)
            return result

    def run_bound(self, op: str, call: Any, impl: str | None, tensors: tuple[Any, ...],
                  remember: Any = None) -> Any:
        """Bind `call`'s implementation, run it on `tensors` and pass the bound function to `remember` once it
        returned; a kernel that raises is demoted and the call goes to the next implementation (`fail_over`)."""
        decision = self.resolve(op, call, impl=impl)
        while True:
            try:
                fn = self._bound(decision, call)  # a kernel that cannot bind fails over like one that raises
                out = fn(*tensors)
                _raise_for_structure(op, decision.chosen_id, call, out)  # once per signature: it fixes the structure
            except Exception as exc:
                if not self.may_fail_over(decision, impl, exc, call.device):
                    raise
                decision = self._next_decision(op, call, impl, decision, exc)
                continue
            if remember is not None:
                remember(fn)
            self.usage.called(decision, reference_counted=True)  # the bound function counted a reference call
            return out

    def _next_decision(self, op: str, call: Any, impl: str | None, failed: Decision, exc: Exception) -> Decision:
        self.fail_over(failed, exc, call=call)
        try:
            return self.resolve(op, call, impl=impl)
        except NoImplementationError as none_left:
            raise none_left from exc

    def may_fail_over(self, decision: Decision, impl: str | None, exc: BaseException, device: Any) -> bool:
        """Whether `exc` from `decision.chosen` moves the call to the next implementation: settings.
        fallback_on_error, not pinned, not while torch.compile traces or a CUDA graph captures (a fallback there
        would record half a failed graph), and not out of memory."""
        # Under group agreement a failure stays the caller's: failing over on one rank would diverge the group.
        return (impl is None and decision.pinned is None and self.policy.settings.fallback_on_error
                and self.agreement is None and may_fail_over(exc) and not _is_compiling()
                and not is_capturing(device))

    def fail_over(self, decision: Decision, exc: BaseException, *, bound: Any = None, call: Any = None) -> None:
        """Demote `decision.chosen` after `exc` on the call `call` (a call record) or the signature `bound` (the
        function `_bound` made for it) was bound to: for that signature, or for the whole call class once it
        failed on two distinct signatures of it (see `_breaker`). Forget the decisions and the fast-path functions
        the demotion invalidates, so those calls are decided again without that implementation."""
        impl_id = decision.chosen_id
        assert impl_id is not None
        if bound is not None:
            signature, described = getattr(bound, "signature", None), getattr(bound, "described", decision.call)
        elif call is not None:
            signature, described = call.signature(), call.describe()
        else:
            signature, described = None, decision.call  # demoted for the class
        key = decision.cache_key
        demotion, loud = self.breaker.record(key, signature, impl_id, exc, described)
        self.usage.demoted(decision, demotion.scope)
        state = self.state

        def invalidated(d: Any, d_signature: Any) -> bool:
            """Whether a decision (or a function bound to it for `d_signature`) relied on what was demoted."""
            if d is not decision and (d is None or d.cache_key != key or d.chosen_id != impl_id):
                return False
            return demotion.scope == CLASS or d_signature == signature

        for k, d in list(state.decisions.items()):
            if invalidated(d, d.signature if demotion.scope != CLASS else None):
                state.decisions.pop(k, None)  # (a signature's demotion leaves the class's decision in place)
        for k, fn in list(state.fast.items()):
            if invalidated(getattr(fn, "decision", None), getattr(fn, "signature", None)):
                state.fast.pop(k, None)
        for k, template in list(state.size_generic.items()):  # each holds a decision and the function bound to it
            if invalidated(template.decision, template.signature):
                state.size_generic.pop(k, None)
        log.log(logging.WARNING if loud else logging.INFO,
                "%s: %s raised %s on [%s]; the call goes to the next implementation (settings.fallback_on_error); "
                "%s is %s.%s", decision.op, impl_id, demotion.error, described, impl_id,
                demotion.outlook(self.breaker.clock()),
                " Later failures at this scope log at INFO." if loud else "")

def _bound_names(op: str) -> tuple[str, ...]:
    from ..base._ops import op_spec

    arguments = op_spec(op).arguments
    return tuple(arguments.bound + arguments.bound_optional) if arguments is not None else ()


def _tensor_names(op: str, call: Any) -> tuple[str, ...]:
    """The op's arguments that hold a tensor in `call`: the bound ones first (masks, biases, offsets after)."""
    from ..base._ops import op_spec

    arguments = op_spec(op).arguments
    bound = _bound_names(op)
    others = () if arguments is None else tuple(n for n in arguments.names if n not in bound)
    return bound + tuple(n for n in others if _is_tensor(getattr(call, n, None)))


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)



def _result_fix(op: str, chosen: Any, call: Any) -> Any:
    """The op's `OpSpec.result_fix` for this implementation and call (None: the result passes as it is)."""
    from ..base._ops import op_spec

    hook = op_spec(op).result_fix
    return None if hook is None else hook(chosen, call)


def _raise_for_structure(op: str, impl_id: Any, call: Any, result: Any) -> None:
    problems = structure_problems(op, call, result)
    if problems:
        raise ImplementationOutputError(f"{op}: {impl_id} " + "; ".join(problems))


def _invalidate_compiled() -> None:
    """Make compiled graphs re-trace (and so re-decide) after a policy or plugin change — if any were compiled."""
    compiled = sys.modules.get("opdispatch.compile._compile")
    if compiled is not None:
        compiled.invalidate_compiled_decisions()


def _failed_plugins_text(plugins: list[PluginRecord]) -> str:
    failed = [r for r in plugins if r.status == "failed"]
    if not failed:
        return ""
    return "\nPlugins that failed (their implementations are missing):\n" + "\n".join(
        f"  - {r.describe()}" for r in failed)


def _unknown_pin_error(op: str, pin_id: str, prov: Provenance, known: list[str], plugins: list[PluginRecord],
                       decision: Decision) -> PinnedImplementationError:
    disabled = [r for r in plugins if r.status == "disabled"]
    text = (f"{op}: implementation {pin_id!r} pinned by {prov.source} is not registered; registered "
            f"implementations: {', '.join(known) or 'none'}.")
    text += _failed_plugins_text(plugins)
    owner = next((r for r in disabled if r.name == pin_id.split(".")[0]), None)
    if owner is not None:  # installed, but switched off: installing it again would not help
        text += (f"\nIts plugin {owner.name!r} is installed but disabled: {owner.error}."
                 f"\nFix: enable plugin {owner.name!r} (OPDISPATCH_PLUGINS / OPDISPATCH_DISABLE_PLUGINS), or pin "
                 "one of the registered implementations.")
        return PinnedImplementationError(text, decision=decision)
    if disabled:
        text += "\nDisabled plugins: " + ", ".join(f"{r.name} ({r.error})" for r in disabled)
    text += "\nFix: install the plugin that provides it, or pin one of the registered implementations."
    return PinnedImplementationError(text, decision=decision)


def _no_impl_error(decision: Decision, plugins: list[PluginRecord]) -> NoImplementationError:
    demoted = [c.impl_id for c in decision.candidates if c.status == DEMOTED]
    raised = (f"\n{', '.join(demoted)} could take it but raised at run time (their errors are above): fix or "
              "report those kernels; pin one with impl= to see its error.") if demoted else ""
    return NoImplementationError(
        f"no implementation of {decision.op} can take this call.\n{decision}\n"
        + _failed_plugins_text(plugins) + raised
        + "\nFix: change the call (dtype, head_dim, features) to one a candidate supports, install a vendor "
        "plugin that supports it, or relax the policy's deny list.", decision=decision)


_MANAGERS: weakref.WeakSet[OpManager] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # Locks may be held by threads that do not exist in the child; device state does not survive a fork.
    for manager in list(_MANAGERS):
        manager._lock = threading.RLock()
        manager.registry._lock = threading.Lock()
        manager.breaker._lock = threading.Lock()
        manager.usage._lock = threading.Lock()
        manager._shadow, manager._shadow_read = None, False  # its worker thread is not in the child: read anew
        manager._devices = {}
        if manager._state is not None:
            manager._use(manager._state.fresh())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
