"""The policy's weight versions and their transport (ebpo.rl.weights).

* a restarted rollout worker gets back the version it held, not the newest one published; holding a version
  already held loads nothing and a new one loads once; the `Weights` record is a version and a reference;
* broadcast mode, against fakes of Ray, the learner and the rollout workers that record every call: the group is
  formed with the documented ranks and device; a sync broadcasts the next version to every member; a worker
  restarted since the group formed, a failed broadcast or a group that cannot form makes that sync use the object
  store and re-forms the group; after MAX_BROADCAST_FAILURES failures in a row the run stays on the object store."""
import types

import pytest

from ebpo.rl.weights import PolicyWeights, Weights, brief


class Ref:
    """What a fake `.remote()` returns: a value, or an exception that `ray.get` raises."""

    def __init__(self, value=None, error=None):
        self.value, self.error = value, error


class FakeRay:
    def __init__(self):
        self.waits = []

    def wait(self, refs, num_returns=1, timeout=None):
        self.waits.append((len(refs), num_returns, timeout))
        return refs, []

    def get(self, ref):
        if ref.error is not None:
            raise ref.error
        return ref.value


class Method:
    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def remote(self, *args):
        return self.owner.answer(self.name, args)


class Handle:
    def __init__(self, worker):
        self.worker = worker

    def __getattr__(self, name):
        return Method(self.worker, name)


class Worker:
    def __init__(self, log, i):
        self.log, self.i, self.restarts, self.fail = log, i, 0, {}
        self.handle = Handle(self)

    def answer(self, name, args):
        self.log.append((f"w{self.i}", name, args))
        return Ref(None, self.fail.get(name))

    def submit(self, method, *args):
        self.log.append((f"w{self.i}", method, args))
        return ("ticket", method, args)

    def result(self, ticket):
        assert ticket[0] == "ticket", ticket  # the ticket submit gave for this call
        self.log.append((f"w{self.i}", "result", ticket[1:]))
        return None


class Learner:
    def __init__(self, log):
        self.log, self.fail, self.parts = log, {}, 0

    def _call(self, name, args, value=None):
        self.log.append(("learner", name, args))
        return Ref(value, self.fail.get(name))

    def weight_parts(self, bucket_bytes):
        self.parts += 1
        self.log.append(("learner", "weight_parts", (bucket_bytes,)))
        return f"parts{self.parts}"

    def sync_endpoint(self):
        return self._call("sync_endpoint", (), ("10.0.0.1", 4242))

    def join_sync_group(self, *args):
        return self._call("join_sync_group", args)

    def broadcast_weights(self, version, bucket_bytes):
        return self._call("broadcast_weights", (version, bucket_bytes), {"bytes": 1000 * version, "buckets": 3})

    def close_sync_group(self):
        return self._call("close_sync_group", ())


def make(n_workers=2, learner_gpus=0, rollout_gpus=0, bucket_mb=0.5):
    log, events = [], []
    cfg = types.SimpleNamespace(weight_sync="broadcast", bucket_mb=bucket_mb, sync_timeout_s=7.0,
                                learner_gpus=learner_gpus, rollout_gpus=rollout_gpus)
    ray = FakeRay()
    pw = PolicyWeights(ray, cfg, events.append)
    learner, workers = Learner(log), [Worker(log, i) for i in range(n_workers)]
    pw.attach(learner, workers)
    return pw, log, events, learner, workers, ray


def calls(log, name):
    return [(who, args) for who, n, args in log if n == name]


@pytest.mark.parametrize("n_workers", [1, 3])
@pytest.mark.parametrize("gpus,device", [((0, 0), "cpu"), ((1, 0), "cpu"), ((0, 1), "cpu"), ((0.5, 1), "cpu"),
                                         ((1, 1), "cuda"), ((2, 1), "cuda")])
def test_attach_forms_the_group_learner_rank_0_workers_after_it(n_workers, gpus, device):
    pw, log, events, learner, workers, ray = make(n_workers, *gpus)
    n = n_workers + 1
    assert calls(log, "ping") == [(f"w{i}", ()) for i in range(n_workers)]  # dead workers restarted first
    assert calls(log, "join_sync_group") == [("learner", ("10.0.0.1", 4242, n, 7.0, device))] + [
        (f"w{i}", ("10.0.0.1", 4242, i + 1, n, 7.0, device)) for i in range(n_workers)]
    # the group is closed on every member first, waiting at most 60 s
    assert calls(log, "close_sync_group")[0] == ("learner", ()) and len(calls(log, "close_sync_group")) == n
    assert ray.waits[0] == (n, n, 60)
    assert pw.group_restarts == [0] * n_workers and not events and pw.broadcast_failures == 0


@pytest.mark.parametrize("bucket_mb,bucket_bytes", [(0.5, 2**19), (1.0, 2**20), (1e-9, 1)])
def test_a_sync_broadcasts_the_next_version_to_every_member(bucket_mb, bucket_bytes):
    pw, log, events, learner, workers, ray = make(bucket_mb=bucket_mb)
    for v in (1, 2, 3):
        del log[:]
        m = pw.sync()
        assert pw.version == v
        assert m == {"sync/bytes": float(1000 * v), "sync/buckets": 3.0}
        assert calls(log, "broadcast_weights") == [("learner", (v, bucket_bytes))]
        assert calls(log, "receive_weights") == [("w0", (v,)), ("w1", (v,))]
        assert not calls(log, "load_weights") and not calls(log, "weight_parts")  # no object store
    assert not events and pw.broadcast_failures == 0


def test_a_worker_restarted_since_the_group_formed_falls_back_and_reforms():
    pw, log, events, learner, workers, ray = make()
    workers[1].restarts = 1
    del log[:]
    m = pw.sync()
    assert m == {"sync/bytes": 0.0, "sync/buckets": 0.0}
    assert not calls(log, "broadcast_weights")
    assert calls(log, "load_weights") == [("w0", ("parts1", 1)), ("w1", ("parts1", 1))]  # the object store
    assert len(events) == 1 and "restarted" in events[0] and "v1" in events[0]
    assert pw.group_restarts == [0, 1]  # re-formed with the new member
    assert pw.restart_weights() == {"weights": "parts2", "weights_version": 1}  # asks the learner
    assert pw.broadcast_failures == 0
    del log[:]
    assert pw.sync()["sync/buckets"] == 3.0  # the next sync broadcasts again


@pytest.mark.parametrize("who", ["learner", "w0", "w1"])
def test_a_failed_broadcast_counts_falls_back_and_reforms(who):
    pw, log, events, learner, workers, ray = make()
    target = learner if who == "learner" else workers[int(who[1])]
    target.fail["broadcast_weights" if who == "learner" else "receive_weights"] = RuntimeError("gloo timeout\nmore")
    m = pw.sync()
    assert m == {"sync/bytes": 0.0, "sync/buckets": 0.0} and pw.broadcast_failures == 1
    assert calls(log, "load_weights")[-2:] == [("w0", ("parts1", 1)), ("w1", ("parts1", 1))]
    assert any("broadcast failed (RuntimeError: gloo timeout)" in e for e in events)
    target.fail.clear()
    assert pw.sync()["sync/buckets"] == 3.0 and pw.broadcast_failures == 0  # a success resets the count


def test_after_max_failures_in_a_row_the_run_stays_on_the_object_store():
    pw, log, events, learner, workers, ray = make()
    learner.fail["broadcast_weights"] = RuntimeError("nccl")
    for k in range(1, PolicyWeights.MAX_BROADCAST_FAILURES + 1):
        pw.sync()
        assert pw.broadcast_failures == k
    assert any("object store carries the weights for the rest of the run" in e for e in events)
    learner.fail.clear()
    del log[:]
    for v in (4, 5):
        assert pw.sync() == {"sync/bytes": 0.0, "sync/buckets": 0.0}
        assert pw.version == v and not calls(log, "broadcast_weights")
        assert calls(log, "load_weights")[-1] == ("w1", (f"parts{learner.parts}", v))
        assert pw.restart_weights()["weights_version"] == v


def test_a_group_that_cannot_form_is_counted_and_the_next_sync_falls_back():
    log, events = [], []
    cfg = types.SimpleNamespace(weight_sync="broadcast", bucket_mb=1.0, sync_timeout_s=5.0, learner_gpus=0,
                                rollout_gpus=0)
    pw = PolicyWeights(FakeRay(), cfg, events.append)
    learner, workers = Learner(log), [Worker(log, 0)]
    workers[0].fail["join_sync_group"] = OSError("port in use")
    pw.attach(learner, workers)
    assert pw.group_restarts is None and pw.broadcast_failures == 1
    assert len(events) == 1 and "could not form the broadcast group (OSError: port in use)" in events[0]
    workers[0].fail.clear()
    m = pw.sync()
    assert m == {"sync/bytes": 0.0, "sync/buckets": 0.0} and "no weight-sync group" in events[1]
    assert pw.group_restarts == [0]  # formed this time


def test_get_all_waits_for_every_call_then_raises_the_first_error():
    pw, log, events, learner, workers, ray = make()
    refs = [Ref(1), Ref(None, ValueError("a")), Ref(3), Ref(None, KeyError("b"))]
    with pytest.raises(ValueError, match="a"):
        pw._get_all(refs)
    assert ray.waits[-1] == (4, 4, None)
    assert pw._get_all([Ref(1), Ref(2)]) == [1, 2]


def test_detach_closes_the_group_and_forgets_the_learners_references():
    pw, log, events, learner, workers, ray = make()
    pw.sync()
    del log[:]
    pw.detach()
    assert pw.group_restarts is None and len(calls(log, "close_sync_group")) == 3
    assert pw.published is None and pw.restart_weights() == {"weights": "parts1", "weights_version": 1}


def test_state_restore_reset():
    pw, *_ = make()
    pw.sync()
    pw.sync()
    assert pw.state() == {"version": 2}
    pw.restore({"version": "7"})
    assert pw.version == 7 and pw.state() == {"version": 7}
    pw.reset()
    assert pw.version == 0


def test_brief_is_type_and_first_nonempty_line_of_the_cause():
    assert brief(ValueError("\n  first line  \nsecond")) == "ValueError: first line"
    assert brief(RuntimeError("")) == "RuntimeError: "
    wrapped = RuntimeError("ray task error")
    wrapped.cause = KeyError("inner")
    assert brief(wrapped) == "KeyError: 'inner'"
    assert brief(OSError("x" * 400)) == "OSError: " + "x" * 300


def test_every_weight_read_asks_for_the_configured_bucket_size():
    for bucket_mb, bucket_bytes in [(0.25, 2**18), (2.0, 2**21)]:
        pw, log, events, learner, workers, ray = make(bucket_mb=bucket_mb)
        workers[0].restarts = 1  # the sync falls back to the object store
        pw.sync()
        pw.restart_weights()  # broadcast mode: asks the learner
        pw.current()
        sizes = [args for who, args in calls(log, "weight_parts")]
        assert len(sizes) == 3 and all(a == (bucket_bytes,) for a in sizes)


def test_the_ping_before_forming_waits_on_each_workers_own_call():
    pw, log, events, learner, workers, ray = make(3)
    assert [(who, args) for who, args in calls(log, "result") if args[0] == "ping"] == [
        (f"w{i}", ("ping", ())) for i in range(3)]


def test_a_failing_learner_join_or_endpoint_fails_the_formation_and_failures_add_up():
    for method in ("join_sync_group", "sync_endpoint"):
        log, events = [], []
        cfg = types.SimpleNamespace(weight_sync="broadcast", bucket_mb=1.0, sync_timeout_s=5.0, learner_gpus=0,
                                    rollout_gpus=0)
        pw = PolicyWeights(FakeRay(), cfg, events.append)
        learner, workers = Learner(log), [Worker(log, 0), Worker(log, 1)]
        learner.fail[method] = TimeoutError("store")
        pw.attach(learner, workers)
        assert pw.group_restarts is None and pw.broadcast_failures == 1
        pw.sync()  # no group: object store, and the re-formation fails again
        assert pw.broadcast_failures == 2 and pw.group_restarts is None
        assert events[-1] == ("weight sync: could not form the broadcast group (TimeoutError: store); the next sync "
                              "uses the object store and tries again")


def test_the_fall_back_event_says_why_and_what_happens():
    pw, log, events, learner, workers, ray = make()
    pw.close_group()  # no group now
    pw.sync()
    workers[1].restarts = 2
    pw.sync()
    assert events == [
        "weight sync v1: no weight-sync group; using the object store for this sync and re-forming the broadcast group",
        "weight sync v2: a rollout worker was restarted since the weight-sync group was formed; using the object "
        "store for this sync and re-forming the broadcast group"]


def test_once_on_the_object_store_a_sync_says_nothing_and_tries_no_group():
    pw, log, events, learner, workers, ray = make()
    learner.fail["broadcast_weights"] = RuntimeError("nccl")
    for _ in range(PolicyWeights.MAX_BROADCAST_FAILURES):
        pw.sync()
    learner.fail.clear()
    n_events = len(events)
    del log[:]
    pw.sync()
    assert len(events) == n_events  # no fall-back, no re-formation: it simply stays there
    assert not calls(log, "join_sync_group") and not calls(log, "close_sync_group")


def test_published_starts_as_nothing_and_holding_it_loads_nothing():
    pw, log, events, learner, workers, ray = make()
    assert pw.published is None
    del log[:]
    with pw.holding(pw.published):
        pass
    assert not calls(log, "load_weights")
    w = pw.current()
    assert w.ref == "parts1" and pw.publish().ref == "parts2" and pw.published.version == 1


class _Worker:
    """A rollout worker as `PolicyWeights` sees it (a ResilientActor): records the versions it loads."""

    def __init__(self):
        self.loaded, self.restarts = [], 0

    def submit(self, method, *args):
        return method, args

    def result(self, ticket):
        method, args = ticket
        if method == "load_weights":
            self.loaded.append(args[1])


class _Learner:
    def __init__(self):
        self.parts = 0

    def weight_parts(self, bucket_bytes):
        self.parts += 1
        return f"parts{self.parts}"


def _weights(mode="object_store"):
    cfg = types.SimpleNamespace(weight_sync=mode, bucket_mb=1.0, sync_timeout_s=10.0, learner_gpus=0, rollout_gpus=0)
    pw = PolicyWeights(None, cfg, lambda msg: None)
    pw.learner, pw.rollout_workers = _Learner(), [_Worker(), _Worker()]
    return pw


def test_a_restarted_worker_gets_the_version_it_held_not_the_newest_published():
    """Asynchronous loop: versions are published ahead of the one the workers hold; whichever version is held
    when a worker restarts, and however many newer ones exist, the restart brings back that version."""
    for n_published, held in [(3, 1), (3, 2), (3, 3), (5, 1), (5, 4), (2, 0)]:
        pw = _weights()
        published = [pw.current()] + [pw.publish() for _ in range(n_published)]
        assert [w.version for w in published] == list(range(n_published + 1))
        with pw.holding(published[held]):
            assert all(w.loaded[-1] == held for w in pw.rollout_workers)
            r = pw.restart_weights()
            assert r == {"weights": published[held].ref, "weights_version": held}
        # after the block the workers still hold that version: a restart then brings it back as well
        assert pw.restart_weights() == {"weights": published[held].ref, "weights_version": held}


def test_holding_a_version_already_held_loads_nothing_and_a_new_one_loads_once():
    pw = _weights()
    v = [pw.current()] + [pw.publish() for _ in range(3)]
    with pw.holding(v[1]):
        pass
    with pw.holding(v[1]):
        pass
    with pw.holding(None):
        assert pw.restart_weights()["weights_version"] == 1
    with pw.holding(v[3]):
        pass
    assert all(w.loaded == [1, 3] for w in pw.rollout_workers)
    assert pw.restart_weights() == {"weights": v[3].ref, "weights_version": 3}


def test_synchronous_restart_gets_the_last_synced_version():
    pw = _weights()
    assert pw.restart_weights() == {"weights": None, "weights_version": 0}  # the base model before any sync
    for k in range(1, 4):
        pw.sync()
        assert all(w.loaded[-1] == k for w in pw.rollout_workers)
        assert pw.restart_weights() == {"weights": f"parts{k}", "weights_version": k}
    pw.detach()
    assert pw.restart_weights()["weights_version"] == 3


def test_weights_record_is_version_and_ref():
    assert Weights(3, "r") == (3, "r") and Weights(3, "r").version == 3
