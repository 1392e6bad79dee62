"""Rounds under secure aggregation (run config `secure-aggregation = true`): the server
coordinates SecAgg+'s stages (fedsd.secure.secagg) over Flower's Message API and learns only the
sum of the clients' updates.

Each round: every connected node not yet known is asked who it is (the identify stage: its protocol
id, its identity's key; with the server's copy of the roster, run config `secagg-roster`, a
stranger is left out and named; what a node told is kept for the run and asked again only of a
node that missed the previous round's advertise stage); the identified nodes are the cohort; stage messages
(fedsd.app.secure_sum.MESSAGE_TYPES) go to the nodes still in, each through its ClientApp to its
owner's data service, which answers. The round runs on the graph its cohort takes (run config
`secagg-graph`: the complete graph, or the ring every owner derives; fedsd.app.server.secure_plans.round_graph).
A node that does not answer a stage, or answers with
anything but what the stage carries, is dropped; a refusal that names a culprit is kept. Below
the threshold at any stage the round is abandoned and logged, nothing is unmasked, and the global
model stays as it was. Under noise=distributed the masked-input stage carries the round's noise
plan (`distributed_plan`), and the decoded sum is the gradient of the server's optimizer step
(`SecureRounds._step`) rather than a mean update. A decoded sum above what honest clients send \
(fedsd.secure.sum_bound) is refused
the same way. Otherwise the sum (uint64) becomes the mean update of the survivors
(fedsd.app.secure_sum.apply_sum). Every round's protocol record (who was in at each stage, bytes each
way, seconds, culprits, the mean update's norm and its bound) goes to
<out>/secure-aggregation.json, and its sum to <out>/secagg-sum-<round>.npy.

The stage messages, the identify stage and the five stages after it are
fedsd.app.server.stage_exchange; the noise plan and the bound a local-noise sum is checked
against, fedsd.app.server.secure_plans.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import time
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from fedsd.errors import ConfigError
from fedsd.secure import client_level, distributed_noise, sum_bound
from fedsd.secure.identity import read_roster
from fedsd.secure.secagg_server import RoundAbandoned, SecAggServer
from fedsd.settings.federation import deployed_honest_clients
from fedsd.app import secure_sum
from fedsd.app.records import model_to_record, record_to_model, with_frozen
from fedsd.app.server.run_exchange import RunExchange
from fedsd.app.server.secure_plans import distributed_plan, local_noise_bound, round_graph
from fedsd.app.server.stage_exchange import Exchange, cohort_threshold, identify, protocol, refusals, reported
from fedsd.app.server.strategy import NoClientCanTrain


class SumOutsideBound(RoundAbandoned):
    """The decoded sum is above what the round's clients could send honestly: one of those summed
    sent an input outside the bound (or a mask other than its signed seed), and nothing short of
    a proof on each input says which (docs/algorithms.md, "Spoilers named")."""


def cannot_go_on(server_round: int, record: dict, exchange: Exchange) -> str:
    """Why the run stops after an abandoned round ("" where it goes on): owners refused it at
    stage 0, where the plan and their budgets are tried, and too few were left for the threshold.
    In round 1 whatever they said (the next round asks the same of the same owners, and the run
    would release its initial model); later only for budget refusals, which no later round
    changes, so going on would abandon every round."""
    refused = {}  # where the budgets and plan are tried: stage 0, or the multi-round setup and masked input
    for stage in ("advertise", "mr_setup", "mr_masked"):
        for reason, count in refusals(exchange, stage).items():
            refused[reason] = refused.get(reason, 0) + count
    cohort, threshold = record.get("cohort", []), record.get("threshold", 1)
    if not record.get("abandoned") or not refused or len(cohort) - sum(refused.values()) >= threshold:
        return ""
    if server_round > 1 and not all("budget" in reason for reason in refused):
        return ""
    return (f"round {server_round}: {sum(refused.values())} of {len(cohort)} owners refused the round before anyone "
            f"released, leaving fewer than the threshold of {threshold}, so the run stops: "
            + "; ".join(f"{count} refused: {reason}" for reason, count in refused.items()))


class SecureRounds:
    """The run's rounds under secure aggregation, with the ServerApp's round book and strategy's
    records (who trained, each client's ε) kept as a plain run keeps them."""

    def __init__(self, grid: Grid, side, launch):
        self.grid, self.side, self.launch = grid, side, launch
        self.distributed = launch.fed.noise == "distributed"
        self.adaptive = None  # --update-clip-quantile: the rule that moves S (fedsd.secure.client_level)
        if self.distributed:  # the round's plan, and the server's half of each step (fedsd.secure.distributed_step)
            self.noise, self.optimizer = distributed_plan(side.cfg, launch.fed, side.num_classes)
            if self.optimizer.update_clip is not None:
                self.adaptive = client_level.AdaptiveUpdateClip.of(launch.fed, self.noise)
        self.roster = read_roster(launch.fed.secagg_roster) if launch.fed.secagg_roster else None
        round_graph(launch.fed, launch.fed.num_clients)  # a federation no graph fits: refused before round 1
        self.out = Path(launch.out) if launch.out is not None else None
        self.records: list[dict] = []
        self.barred: dict[int, str] = {}  # protocol id → the round it spoiled, with checkable evidence
        self.known: dict[int, dict] = {}  # node → what it told at identify, checked (`identify`, `forget`)
        self.evidence: list[dict] = []  # what proves it, sent to every owner at each later advertise
        self.outside: list[tuple[int, frozenset]] = []  # (round, the clients summed) of each sum outside the bound
        self._seat_key = secrets.token_bytes(16)  # the order `_seated` keeps clients in, no member's to choose
        self.names: dict[int, str] = {}  # protocol id → its roster name, else its node id (Exchange.name)
        self.runs = None  # secure-sum = multi-round: the run's protocol, set up at its first round (RunExchange)
        if launch.fed.secure_sum == "multi-round":
            self.runs = RunExchange(grid.run.run_id, launch.experiment_id, launch.fed.secagg_threshold)

    def named(self, culprit: str) -> str:
        """A culprit (its protocol id, or "node N") as the summary names clients."""
        return self.names.get(int(culprit), f"client {culprit}") if culprit.isdigit() else culprit

    def result_facts(self) -> dict:
        """What the run's result.json says beside the rounds: the noise plan (distributed noise),
        and each client the rounds name by protocol id, by its roster name or node id."""
        facts = {"client_names": {str(k): v for k, v in sorted(self.names.items())}}
        if self.distributed:
            facts["noise"] = self.noise.to_dict()
        return facts

    def run(self, arrays: ArrayRecord) -> ArrayRecord:
        fed = self.launch.fed
        self.side.book.names = self.names  # each round's log line names its clients so
        if self.distributed:
            self._resume_optimizer()
        for launch_round in range(1, fed.rounds - self.launch.round + 1):
            arrays = with_frozen(self.one_round(self.launch.round + launch_round, arrays), self.side.strategy.frozen)
            self.side.book.evaluate_global(launch_round, arrays)
        return arrays

    def _resume_optimizer(self) -> None:
        """Under noise=distributed the server's optimizer goes on from the checkpoint's state (its
        momentum), so a resumed run steps as an uninterrupted one would; its state goes into
        every round's checkpoint (RoundBook). A checkpoint of an earlier fedsd has none: momentum
        starts again, said in the log."""
        saved = self.launch.optimizer if self.launch.round else None
        if saved is not None:
            self.optimizer.load_state_dict(saved)
        elif self.launch.round and self.side.cfg.momentum:
            log(WARNING, "fedsd: the checkpoint holds no server optimizer state (an earlier fedsd's): momentum "
                "starts again at round %d", self.launch.round + 1)
        self.side.book.server_optimizer = self.optimizer

    def one_round(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        fed, experiment = self.launch.fed, self.launch.experiment_id
        started = time.perf_counter()
        exchange = Exchange(self.grid, server_round, fed.round_timeout, list(self.grid.get_node_ids()), self.roster)
        base = {"experiment-id": experiment, "server-round": server_round}
        record = dict(round=server_round)
        try:
            rid = secure_sum.round_id(self.grid.run.run_id, experiment, server_round)
            identities = self._seated(exchange, identify(exchange, base, self.roster, rid, self.barred, self.known),
                                      record)
            cohort = sorted(exchange.nodes)
            self.names.update({client: exchange.name(client) for client in cohort})
            plain = sorted(exchange.nodes[c] for c, who in identities.items() if not who["authenticated"])
            length = self.round_plan().dim if self.distributed else secure_sum.vector_length(arrays)
            server = self._server(rid, cohort, length, record, {c: who["v"] for c, who in identities.items()
                                                                if who["v"]})
            record.update(cohort=cohort, threshold=server.threshold, nodes_without_roster=plain)
            if plain:
                log(WARNING, "secure aggregation round %d: %d nodes take part without a roster: they are protected "
                    "only against a server that follows the protocol", server_round, len(plain))
            plan = distributed_noise.to_settings(self.round_plan(), fed.rounds) if self.distributed else {}
            train = RecordDict({"arrays": arrays, "config": ConfigRecord({**self.side.strategy.settings, **base,
                                                                          **plan})})
            total, replies = self._summed(exchange, server, base, train, record, length)
            try:
                checked = self._checked(arrays, total, server, server_round)
            except SumOutsideBound:  # one of those summed sent it; who, no one can say: none of them meet again
                self.outside.append((server_round, frozenset(server.masked)))
                record["summed_outside_bound"] = sorted(server.masked)
                raise
            arrays = self._applied(arrays, checked, total, server, record, replies)
            if self.out is not None:
                np.save(self.out / f"secagg-sum-{server_round}.npy", total)
        except RoundAbandoned as e:
            log(WARNING, "secure aggregation round %d abandoned: %s", server_round, e)
            record.update(survivors=[], abandoned=str(e))
            for reason, count in refusals(exchange).items():  # each distinct reason once, with its count
                log(WARNING, "secure aggregation round %d: %d client(s) refused: %s", server_round, count, reason)
        self.forget(exchange)
        record.update(culprits=exchange.named, stages=exchange.stages, seconds=time.perf_counter() - started,
                      bytes_sent=sum(s["bytes_sent"] for s in exchange.stages.values()),
                      bytes_received=sum(s["bytes_received"] for s in exchange.stages.values()))
        for culprit, why in exchange.named.items():
            log(WARNING, "secure aggregation round %d: %s named: %s", server_round, self.named(culprit), why)
        log(INFO, "secure aggregation round %d: %d of %d clients summed, %.1f s, %d bytes sent, %d received",
            server_round, len(record["survivors"]), len(record.get("cohort", [])), record["seconds"],
            record["bytes_sent"], record["bytes_received"])
        self.records.append(record)
        if self.out is not None:
            (self.out / "secure-aggregation.json").write_text(json.dumps(self.records, indent=1))
        stop = cannot_go_on(server_round, record, exchange)
        if stop:
            raise NoClientCanTrain(stop)
        return arrays

    def _server(self, rid: bytes, cohort: list[int], length: int, record: dict, signers: dict[int, bytes]):
        """The round's server: on the graph this cohort runs on (`round_graph`; a cohort no graph fits,
        after owners left, abandons the round), each advert signed by the key its sender identified
        with (`signers`), or the run's multi-round protocol."""
        fed = self.launch.fed
        try:
            graph = round_graph(fed, len(cohort))
        except ConfigError as e:
            raise RoundAbandoned(f"secure aggregation: a cohort of {len(cohort)}: {e}") from None
        if self.runs is not None:
            record["graph"] = "complete"
            return self.runs.facts(cohort)
        if graph is None:
            record["graph"] = "complete"
            return SecAggServer(rid, cohort, length, threshold=cohort_threshold(len(cohort), fed.secagg_threshold),
                                signers=signers)
        record["graph"] = dict(k=graph.k, threshold=graph.threshold)
        numbers = {"k": graph.k, "honest": deployed_honest_clients(fed), "colluders": fed.secagg_max_colluders}
        return SecAggServer(rid, cohort, length, threshold=graph.threshold, graph=numbers, signers=signers)

    def _summed(self, exchange: Exchange, server, base: dict, train: RecordDict, record: dict,
                length: int) -> tuple[np.ndarray, list]:
        """The round's protocol: the per-round stages, or (secure-sum = multi-round) the run's, set up
        once, two exchanges a round (fedsd.app.server.run_exchange); the sum and the summed replies."""
        evidence, server_round = json.dumps(self.evidence) if self.evidence else "", record["round"]
        try:
            if self.runs is None:
                return protocol(exchange, server, base, train, evidence)
            summed = self.runs.round(exchange, server, server_round, base, train, evidence, length)
            record["cohort"] = sorted(exchange.nodes)
            return summed
        finally:
            self._bar(server, record, server_round)
            exchange.named.update({str(k): v for k, v in server.culprits.items()})

    def _seated(self, exchange: Exchange, identities: dict[int, dict], record: dict) -> dict[int, dict]:
        """The clients this round seats: no two summed in one round whose sum fell outside the bound
        (SumOutsideBound) sit in one round again. One of them sent that input, so every later round
        an honest owner pays for beside a spoiler holds a spoiler not in any earlier such round of
        its own: at most one spoiled round per member. Who is kept follows an order drawn from the
        server's secret (`_seat_key`), so a member cannot grind its key into the seat. Those left
        out are in the round's `not_seated`; the run stops, before anyone is charged, when fewer
        than a round needs are left (with every client in that round, at once)."""
        if not self.outside:
            return identities
        kept: list[int] = []
        order = sorted(identities, key=lambda c: hashlib.sha256(self._seat_key + str(c).encode()).digest())
        for client in order:
            met = [r for r, summed in self.outside if client in summed and any(k in summed for k in kept)]
            if met:
                record.setdefault("not_seated", {})[str(client)] = (
                    f"summed in round {met[0]}, whose sum fell outside the bound, with a client this round seats")
            else:
                kept.append(client)
        least = self.round_plan().honest if self.distributed else 2
        if len(kept) < least:
            rounds = ", ".join(str(r) for r, _ in self.outside)
            raise NoClientCanTrain(
                f"round {exchange.server_round}: the sum of round(s) {rounds} fell outside the bound, so one of the "
                f"clients summed in each sent an input outside it; without a proof on each input no one can say "
                f"which, and no two of them sit in one round again, which leaves {len(kept)} client(s) for a round "
                f"that needs {least}: the run stops (the clients summed in each: summed_outside_bound in "
                f"secure-aggregation.json)")
        kept.sort()
        exchange.identified({client: exchange.nodes[client] for client in kept})
        return {client: identities[client] for client in kept}

    def round_plan(self):
        """This round's noise plan: the run's, at clip S' of the update clip S now where S adapts."""
        return client_level.round_plan(self.noise, self.adaptive, self.optimizer.update_clip)

    def forget(self, exchange: Exchange) -> None:
        """A node that did not answer this round's advertise stage, or that its neighbours named, is
        asked who it is again in the next round (its SuperNode may have come back with another
        owner's service behind it)."""
        stage = "advertise" if self.runs is None else "mr_masked"
        answered = set(exchange.stages.get(stage, {}).get("answered", []))
        named = {str(culprit) for culprit in exchange.named}  # named by its neighbours: asked again too
        if stage in exchange.stages:
            for node in [node for node in self.known if exchange.ids.get(node) not in answered
                         or str(exchange.ids.get(node)) in named]:
                del self.known[node]

    def _applied(self, arrays, checked, total, server: SecAggServer, record: dict, replies) -> ArrayRecord:
        """The checked sum applied: under distributed noise the server's step, else the mean
        update; the survivors' reports kept as a plain round keeps them."""
        server_round = record["round"]
        if self.distributed:
            arrays, applied = checked
            record.update(applied)
        else:
            record.update(zip(("mean_update_norm", "honest_bound"), checked))
            arrays = secure_sum.apply_sum(arrays, total, len(server.masked))
        self._reports(server_round, replies, sorted(server.masked))
        record.update(survivors=sorted(server.masked), abandoned=None)
        return arrays

    def _checked(self, arrays, total, server: SecAggServer, server_round: int) -> tuple:
        """The round's sum checked against the bound on an honest one: under distributed noise the
        stepped model and what was applied, else the mean update's norm and its bound
        (RoundAbandoned where it fails)."""
        if self.distributed:
            return self._step(arrays, total, len(server.masked), server, server_round)
        return self._check_sum(total, len(server.masked), server)

    def _bar(self, server: SecAggServer, record: dict, server_round: int) -> None:
        """Each dealer whose t committed shares rebuilt a secret other than the one it signed
        (SecAggServer.evidence, which fedsd.secure.secagg_primitives.verify_blame checks) is named in the
        round's record with its evidence and left out of every later round of this run; the
        evidence goes to every owner at each later advertise. Honest owners so pay for one such
        round at most per member. An input outside the bound is not found so (docs/algorithms.md):
        SumOutsideBound and `_seated` hold its cost to one round per member."""
        if server.evidence:
            evidence = {dealer: {**item, "round": server_round} for dealer, item in server.evidence.items()}
            record["evidence"] = {str(k): v for k, v in evidence.items()}
            self.evidence.extend(evidence.values())
            for dealer in evidence:
                self.barred[dealer] = (f"spoiled round {server_round} (shares that rebuild another secret than it "
                                       f"signed, evidence in secure-aggregation.json): left out of the rest of the run")

    def _step(self, arrays: ArrayRecord, total: np.ndarray, count: int, server: SecAggServer,
              server_round: int) -> tuple[ArrayRecord, dict]:
        """Distributed noise: the decoded sum over the plan's expected batch, as the gradient of
        the server's SGD (momentum included) on the global student, as a simulation applies it
        (fedsd.secure.distributed_step.ServerOptimizer). Refused, nothing applied, when fewer survivors than
        the plan's t sent their shares (the sum would hold less noise than planned), or when the
        sum is above what honest clients send but once in 1e9 rounds (fedsd.secure.sum_bound)."""
        plan = self.round_plan()
        if count < plan.honest:
            raise RoundAbandoned(f"distributed noise: {count} clients' shares in the sum, below the plan's t = "
                                 f"{plan.honest}: less noise than planned; nothing was applied", server.culprits)
        # each share is at most μ / 2 (an owner's t, secagg-min-clients, is at least 2)
        bound = sum_bound.distributed_sum_bound(clip_units=distributed_noise.QUANTISED_CLIP,
                                                expected_batch=plan.expected_batch, variance=count * plan.variance / 2,
                                                dim=plan.dim, clients=count)
        norm = float(np.linalg.norm(total.view(np.int64).astype(np.float64)))
        if not norm <= bound:
            raise SumOutsideBound(f"secure aggregation: the decoded sum has norm {norm:.4g} (quantisation units), "
                                  f"above the {bound:.4g} honest clients stay below (but once in 1e9 rounds); nothing "
                                  f"was applied", server.culprits)
        model, noisy_sum = record_to_model(arrays), distributed_noise.decode(total, plan)
        applied = dict(sum_norm=norm, honest_bound=bound, epsilon=plan.epsilon(server_round, self.side.cfg.delta))
        if self.adaptive is not None:  # S this round; the next from the noised count, the sum's last coordinate
            applied["update_clip"] = clip = self.optimizer.update_clip
            self.optimizer.update_clip, noisy_sum = self.adaptive.next_clip(clip, noisy_sum), noisy_sum[:-1]
        unit = applied["update_clip"] if self.launch.fed.update_clip_normalize else 1.0  # in units of this round's S
        model["student"] = self.optimizer.step(model["student"], noisy_sum, plan, unit)
        if self.launch.fed.privacy_unit == "client":  # each single record's, at sensitivity 2S
            applied["record_epsilon"] = client_level.record_epsilon(plan, server_round, self.side.cfg.delta)
        return model_to_record(model), applied

    def _check_sum(self, total: np.ndarray, count: int, server: SecAggServer) -> tuple:
        """A decoded sum outside what the round's clients could have sent honestly is refused:
        nothing applied (fedsd.secure.sum_bound: every owner scales its update down to the bound,
        so an honest round never fails it)."""
        mean = total.view(np.int64).astype(np.float64) / secure_sum.SCALE / max(count, 1)
        bound = local_noise_bound(self.side.cfg, self.launch.fed, len(total))
        norm = float(np.linalg.norm(mean))
        if not norm <= bound:
            raise SumOutsideBound(f"secure aggregation: the survivors' mean update has norm {norm:.4g}, above the "
                                 f"{bound:.4g} honest clients stay below (but once in 1e9 rounds); nothing was "
                                 f"applied", server.culprits)
        return norm, bound

    def _reports(self, server_round: int, replies: list[RecordDict], ids: list[int]) -> None:
        """Each summed client's report, by its protocol id (`ids`, in the replies' order: never an
        id a member could claim), its ε taken within [0, the run's ε] (a member's 1e9 or inf is
        not the run's result)."""
        strategy, most = self.side.strategy, float(self.side.cfg.epsilon)
        for k, content in enumerate(replies):
            report = reported(content) or {}  # protocol() left out a masked input without one
            strategy.round_clients.setdefault(server_round, {})[ids[k]] = report
            if "epsilon" in report:
                strategy.client_epsilon[ids[k]] = min(max(float(report["epsilon"]), 0.0), most)
