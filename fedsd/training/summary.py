"""What a finished run says on the terminal: a few lines a person reads, not a raw dict.

For a federation it also names every client that did not train in some round and why (its
owner's refusal, a failure of its own, a missed deadline, a spent budget), the budgets its
owners set, and the files any client skipped."""
from __future__ import annotations

import json
from pathlib import Path

from fedsd.models.pretrained import start_line
from fedsd.privacy.accounting import AccountantHistory


def run_summary(result: dict, out) -> str:
    """A finished run in a few lines: what ran, its accuracy, the ε it spent (the range across
    clients in a federation), its time, the clients that did not train, and where its files are."""
    if "secure_aggregation" in result:
        return secure_summary(result, out)
    clients = result.get("num_clients")
    what = f"{result['dataset']} {result['method']}" + (f", {clients} clients" if clients else ", central")
    accuracy = result["test_accuracy"]
    names = result.get("client_names") or {}  # under secure aggregation: roster names, else node ids
    if clients:
        trained = {str(c) for r in result["rounds"] for c in r["trained"]}
        last = result["rounds"][-1]["client_epsilon"] if result["rounds"] else {}
        spent = [e for c, e in last.items() if c in trained]
        eps = (f"{min(spent):.3f}–{max(spent):.3f} across the {len(spent)} clients that trained" if spent
               else "nothing: no client trained")
        honest = (result.get("noise") or {}).get("honest")
        if spent and honest:  # distributed noise: the promise holds while t of them are honest
            eps += f", if at least {honest} of the {clients} clients are honest"
    else:
        eps = f"{result['epsilon_spent']:.3f}"
    by = " (clients' own test splits)" if result.get("evaluated_by") == "clients" else ""
    lines = [f"fedsd: {what} finished, {result['wall_seconds']:.0f} s of training and evaluation",
             f"  test accuracy  {accuracy * 100:.2f} %{by}" if accuracy is not None else "  test accuracy  -",
             f"  ε spent        {eps} (target {result['epsilon_target']:g}, δ {result['delta']:g})",
             f"  settings       {settings_line(result)}"]
    if result.get("pretrained"):
        lines.append(f"  start          {start_line(result['pretrained'])}")
    prior = (result.get("privacy") or {}).get("prior")
    if prior:  # what the normalisation's releases took of ε, before DP-SGD's first step
        alone = AccountantHistory("rdp", prior).epsilon(result["delta"])
        lines.append(f"  features       {result['config']['features']}, normalised by released statistics "
                     f"(σ = {prior[0][0]:g}; alone they spend ε {alone:.2f}, composed into the total)")
    if result["dataset"] == "custom":  # your own files, and whether a test split was held out of them
        lines.append(f"  data           {result['data_source']}")
    if clients:
        named = [names[c] for c in sorted(names, key=int) if c in trained]
        if named:
            lines.append(f"  clients        {', '.join(named)} trained (by roster name, else node id; result.json "
                         f"names them by protocol id)")
        lines += _labelled("not trained", not_trained(result["rounds"], names))
        lines += _labelled("owners' budget", [f"{client_label(c, names)}: {text}"
                                              for c, text in budgets(result["rounds"]).items()])
        lines += _labelled("skipped files", [f"{client_label(c, names)}: {text}"
                                             for c, text in skipped_files(result["rounds"]).items()])
    lines.append(f"  files          {Path(out).absolute()}/ (result.json, model.pt, curve.png)")
    return "\n".join(lines)


def secure_summary(result: dict, out) -> str:
    """A distributed-noise federation's lines: every client spends the same ε."""
    cfg, fed, cost = result["config"], result["federation"], result["secure_aggregation"]
    honest = (result.get("noise") or {}).get("honest") or fed["honest_clients"] or fed["num_clients"]
    unit = (f"client, protected whole (each single record: ε {result['record_epsilon']:.3f}),"
            if fed.get("privacy_unit") == "client" else "client")
    return "\n".join([
        f"fedsd: {cfg['dataset']} {cfg['method']}, {fed['num_clients']} clients, distributed noise under secure "
        f"aggregation, finished, {result['wall_seconds']:.0f} s",
        f"  test accuracy  {result['test_accuracy'] * 100:.2f} %",
        f"  ε spent        {result['epsilon_spent']:.3f} by every {unit} (target {cfg['epsilon']:g}, δ "
        f"{cfg['delta']:g}), if at least {honest} of the {fed['num_clients']} clients are honest",
        secure_settings(result),
        f"  per round      {cost['bytes_to_server_per_round'] / 1e6:.2f} MB to the server, "
        f"{cost['protocol_seconds_per_round']:.2f} s of the protocol, {cost['round_seconds']:.2f} s in all",
        f"  files          {Path(out).absolute()}/ (result.json, model.pt)"])


def secure_settings(result: dict) -> str:
    cfg, fed = result["config"], result["federation"]
    if fed.get("privacy_unit") == "client":
        return (f"  settings       each client whole: {result['steps']} rounds of {local_work(fed)} "
                f"at B = {cfg['batch_size']}, lr {cfg['lr']:g}, updates clipped to {fed['update_clip']:g}, z = "
                f"{result['noise_multiplier']:.3f}")
    return (f"  settings       B = {cfg['batch_size']} (the federation's), lr {cfg['lr']:g}, z = "
            f"{result['noise_multiplier']:.3f}, {result['steps']} rounds of one step")


def client_label(client: str, names: dict) -> str:
    """A client as the summary names it: its roster name or node id where the run knows it
    (`client_names`, under secure aggregation), else its number."""
    return names.get(str(client)) or f"client {client}"


def settings_line(result: dict) -> str:
    """The resolved settings a person checks first: B, lr, momentum, σ, and the run's length."""
    cfg, fed = result["config"], result.get("federation")
    if fed and fed.get("noise") == "distributed":
        sigma, length = distributed_sigma(result), distributed_length(fed)
    else:
        sigma = result.get("noise_multiplier")
        if isinstance(sigma, dict):  # a federation: each client's own σ
            values = sorted(v for v in sigma.values() if v is not None)
            sigma = (f"{values[0]:.3f}" if values and values[0] == values[-1] else
                     f"{values[0]:.3f}–{values[-1]:.3f}" if values else "-")
        else:
            sigma = f"{sigma:.3f}" if sigma is not None else "-"
        length = (f"{fed['rounds']} rounds × {fed['local_epochs']} local epoch(s)" if fed
                  else f"{cfg['epochs']} epochs")
    passes = result.get("physical_batch_size")
    batch = f"{cfg['batch_size']}" + (f" (in passes of at most {passes})" if passes and passes < cfg["batch_size"]
                                      else "")
    return f"B = {batch}, lr {cfg['lr']:g}, momentum {cfg['momentum']:g}, σ = {sigma}, {length}"


def distributed_sigma(result: dict) -> str:
    """σ under distributed noise: the run's, that of the summed shares (no client adds all of it)."""
    plan = result.get("noise") or {}
    if "noise_multiplier" not in plan:
        return ("- (distributed noise: σ is that of the sum of the clients' shares, over the clip; this result "
                "does not hold the run's plan)")
    return (f"{plan['noise_multiplier']:.3f} (of the sum: each client adds a Skellam share, any t = "
            f"{plan['honest']} of them carry it all; over the clip)")


def distributed_length(fed: dict) -> str:
    """A distributed-noise run's length: one DP-SGD step of the federation a round (record level),
    or each client's local work a round (client level)."""
    if fed.get("privacy_unit") == "client":
        return f"{fed['rounds']} rounds × {local_work(fed)} (each client's update protected whole)"
    return f"{fed['rounds']} rounds of one DP-SGD step (B the federation's)"


def local_work(fed: dict) -> str:
    """A client-level round's work on each client: its local steps, else its local epochs."""
    return f"{fed['local_steps']} local steps" if fed.get("local_steps") else f"{fed['local_epochs']} local epoch(s)"


def _labelled(label: str, items: list[str]) -> list[str]:
    return [f"  {label if i == 0 else '':<14} {item}" for i, item in enumerate(items)]


def last_line(reason: str) -> str:
    """The client's own message from Flower's error text (it ends "Message: <the exception>")."""
    text = reason.strip().rstrip("'>").strip()
    return text.split("Message: ", 1)[-1].strip()


def outcome(record: dict, client: str) -> str | None:
    """Why `client` did not train in this round (None: it trained, or was not asked)."""
    if client in record.get("refused", {}):
        return f"refused: {record['refused'][client]}"
    if client in record.get("rejected", {}):
        return f"its reply was rejected: {record['rejected'][client]}"
    for m in record.get("missed", []):
        if str(m["client"]) == client:
            return f"missed: {last_line(m['reason'])}"
    if int(client) in record.get("skipped", []):
        return "skipped: its privacy budget for the run is spent"
    return None


def not_trained(rounds: list[dict], names: dict | None = None) -> list[str]:
    """'client K in rounds a–b: why', one line per client and reason, in client order (K its
    name where `names` has one: `client_label`)."""
    spans: dict[tuple[str, str], list[int]] = {}
    clients = sorted({str(c) for r in rounds for c in [*r.get("refused", {}), *r.get("rejected", {}),
                                                       *(m["client"] for m in r.get("missed", [])),
                                                       *r.get("skipped", [])] if c is not None}, key=int)
    for client in clients:
        for r in rounds:
            why = outcome(r, client)
            if why:
                spans.setdefault((client, why), []).append(r["round"])
    lines = []
    for (client, why), numbers in spans.items():
        which = f"round {numbers[0]}" if len(numbers) == 1 else f"rounds {_ranges(numbers)}"
        lines.append(f"{client_label(client, names or {})} in {which}: {why}")
    return lines


def nothing_trained(result: dict, out) -> str | None:
    """Why a federation's finished run trained nothing (no round in which a client's update was
    applied), with each distinct reason and how many times it was given; None when one was. What
    a command that ran it says before it exits non-zero: its model is the initial one."""
    rounds = result.get("rounds") or []
    # a round trained: its clients named (a Flower run's), or its survivors counted (a simulated secure sum's)
    if not result.get("num_clients") or any(r.get("trained") or r.get("survivors") for r in rounds):
        return None
    reasons: dict[str, int] = {}
    for r in rounds:
        for client in sorted({str(c) for c in [*r.get("refused", {}), *r.get("rejected", {}),
                                               *(m["client"] for m in r.get("missed", []))] if c is not None}):
            why = outcome(r, client)
            if why:
                reasons[why] = reasons.get(why, 0) + 1
    record = Path(out) / "secure-aggregation.json"
    if record.is_file():  # a secure round abandoned says why in the protocol's record
        for r in json.loads(record.read_text()):
            if r.get("abandoned"):
                why = f"secure aggregation abandoned the round: {r['abandoned']}"
                reasons[why] = reasons.get(why, 0) + 1
    said = "; ".join(f"{why} ({n}×)" if n > 1 else why for why, n in reasons.items())
    return f"no client trained in any of the {len(rounds)} rounds, so the model is the initial one" + (
        f": {said}" if said else "")


def _ranges(numbers: list[int]) -> str:
    """[1, 2, 3, 5] → '1–3, 5'."""
    parts, start = [], numbers[0]
    for prev, cur in zip(numbers, numbers[1:] + [None]):
        if cur is None or cur != prev + 1:  # a run of consecutive rounds ends at prev
            parts.append(f"{start}" if start == prev else f"{start}–{prev}")
            start = cur
    return ", ".join(parts)


def budgets(rounds: list[dict]) -> dict[str, str]:
    """Each client's owner's lifetime limits, as it last reported them."""
    found = {}
    for r in rounds:
        for client, b in r.get("lifetime_budget", {}).items():
            limit = "unlimited (max-epsilon=inf)" if b["max_epsilon"] == "inf" else f"ε ≤ {b['max_epsilon']:g}"
            found[client] = f"{limit}, δ ≤ {b['max_delta']:g}"
    return dict(sorted(found.items(), key=lambda kv: int(kv[0])))


def skipped_files(rounds: list[dict]) -> dict[str, str]:
    """The unreadable files each client left out of its data (node config skip-bad-files)."""
    found = {}
    for r in rounds:
        for client, s in r.get("skipped_files", {}).items():
            names = ", ".join(s["first"]) + (", …" if s["count"] > len(s["first"]) else "")
            found[client] = f"{s['count']} unreadable file(s) left out ({names})"
    return dict(sorted(found.items(), key=lambda kv: int(kv[0])))
