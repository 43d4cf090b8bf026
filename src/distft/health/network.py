"""The environment that commonly breaks multi-node jobs, read before launch: pure functions of a dict.

Most multi-node failures are not in the training code but in how the communication library finds
the network. NCCL (and gloo, on CPU) pick a network interface by themselves: every interface but
`lo` and `docker*`, InfiniBand first. On a node with several (an Ethernet port for management, one
for data, a bridge, an InfiniBand card) they may pick one the other nodes cannot reach, and the job
hangs at its first collective with no message. `network_warnings` names what looks risky;
`failure_advice` is appended to a failed collective's message. Both take the environment as a dict
and the interface names as a list, so they are tested without a network (tests/test_health.py).

| variable                 | what goes wrong                                                         |
|--------------------------|-------------------------------------------------------------------------|
| NCCL_SOCKET_IFNAME unset | several candidate interfaces: NCCL may pick an unroutable one (a hang)  |
| NCCL_SOCKET_IFNAME=eth9  | names no interface of this node: NCCL fails to find one                 |
| NCCL_IB_DISABLE=1        | InfiniBand/RoCE off: inter-node traffic over TCP sockets, often ~10x slower |
| NCCL_P2P_DISABLE=1, NCCL_SHM_DISABLE=1 | GPUs of one node talk through the host or the network     |
| CUDA_VISIBLE_DEVICES     | fewer devices than --nproc (ranks without a GPU) or more (idle GPUs)    |
| GLOO_SOCKET_IFNAME unset | gloo (CPU runs, and any gloo group) has the same interface problem      |
| --rdzv-endpoint public   | the store and the collectives have no authentication: anyone reaching the address can join (docs/security.md) |
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from collections.abc import Mapping

import psutil

# Interfaces NCCL skips unless NCCL_SOCKET_IFNAME names them (its default is "^docker,lo").
_SKIPPED = ("lo", "docker")


def candidate_interfaces(interfaces: list[str]) -> list[str]:
    """The interfaces NCCL and gloo would choose among by default: all but loopback and docker's."""
    return [name for name in interfaces if not name.startswith(_SKIPPED)]


def _matches(spec: str, interfaces: list[str]) -> list[str]:
    """Interfaces selected by an NCCL_SOCKET_IFNAME value: comma-separated prefixes, `=name` for an
    exact name; a value starting with `^` excludes instead (then everything else is selected)."""
    if spec.startswith("^"):
        excluded = [p for p in spec[1:].split(",") if p]
        return [i for i in interfaces if not any(i.startswith(p.lstrip("=")) for p in excluded)]
    exact = spec.startswith("=")
    names = [p for p in spec.lstrip("=").split(",") if p]
    return [i for i in interfaces if any(i == n if exact else i.startswith(n) for n in names)]


def _interface_warning(environ: Mapping[str, str], variable: str, interfaces: list[str]) -> str | None:
    spec = environ.get(variable, "")
    candidates = candidate_interfaces(interfaces)
    if spec:
        if _matches(spec, interfaces):
            return None
        return (
            f"{variable}={spec} selects none of this node's interfaces ({', '.join(interfaces) or 'none'}): "
            f"the library will fail to find a network. Name one that reaches the other nodes."
        )
    if len(candidates) < 2:
        return None
    return (
        f"{variable} is unset and this node has {len(candidates)} candidate network interfaces "
        f"({', '.join(candidates)}): each node may pick a different one, or one the others cannot reach, "
        f"and the job then hangs at its first collective. Set {variable} to the interface that routes to "
        f"the other nodes (e.g. {variable}={candidates[0]}; `ip route get <node 0's address>` names it)."
    )


def network_warnings(
    environ: Mapping[str, str], backend: str, nproc: int, nnodes: int, interfaces: list[str]
) -> list[str]:
    """Warnings about this node's environment for a run of `nnodes` x `nproc` on `backend`.

    `environ`: the environment (os.environ); `interfaces`: this node's network interface names
    that carry an address (`network_interfaces()`).
    """
    warnings = []
    if nnodes > 1:
        variable = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
        warnings.append(_interface_warning(environ, variable, interfaces))
    if backend != "nccl":
        return [w for w in warnings if w]
    if nnodes > 1 and environ.get("NCCL_IB_DISABLE", "0") not in ("", "0"):
        warnings.append(
            f"NCCL_IB_DISABLE={environ['NCCL_IB_DISABLE']}: InfiniBand/RoCE is off, so traffic between "
            "nodes goes over TCP sockets, often ~10x slower. Unset it if the nodes have InfiniBand or RoCE."
        )
    for variable, what in (
        ("NCCL_P2P_DISABLE", "peer-to-peer (NVLink, PCIe)"),
        ("NCCL_SHM_DISABLE", "shared memory"),
    ):
        if nproc > 1 and environ.get(variable, "0") not in ("", "0"):
            warnings.append(
                f"{variable}={environ[variable]}: GPUs of one node cannot use {what} transport; their "
                "traffic takes a slower path. Unset it unless it works around a known fault."
            )
    warnings.append(_visible_devices_warning(environ, nproc))
    return [w for w in warnings if w]


def endpoint_warning(endpoint: str, nnodes: int) -> str | None:
    """A multi-node rendezvous on a public address: torch's store and the gloo/NCCL sockets accept
    any connection that reaches them, with no authentication. Host names are not resolved here."""
    host = endpoint.rsplit(":", 1)[0].strip("[]")
    try:
        public = nnodes > 1 and ipaddress.ip_address(host).is_global
    except ValueError:  # a host name
        return None
    if not public:
        return None
    return (
        f"--rdzv-endpoint {endpoint} is a public address. The rendezvous store and the collectives' "
        "sockets have no authentication: any host that reaches them can join or disturb the job. Use "
        "node 0's address on the cluster's private network, and firewall the ports (docs/security.md)."
    )


def _visible_devices_warning(environ: Mapping[str, str], nproc: int) -> str | None:
    if "CUDA_VISIBLE_DEVICES" not in environ:
        return None
    value = environ["CUDA_VISIBLE_DEVICES"]
    visible = [d for d in value.split(",") if d.strip() and d.strip() != "-1"]
    if len(visible) < nproc:
        return (
            f"CUDA_VISIBLE_DEVICES={value!r} shows {len(visible)} GPU(s) but --nproc is {nproc}: each rank "
            f"takes GPU LOCAL_RANK, so local ranks {len(visible)}..{nproc - 1} have none."
        )
    if len(visible) > nproc:
        return (
            f"CUDA_VISIBLE_DEVICES={value!r} shows {len(visible)} GPUs but --nproc is {nproc}: "
            f"{len(visible) - nproc} of them stay idle."
        )
    return None


def failure_advice(environ: Mapping[str, str], backend: str | None) -> str:
    """What to try after a collective failed on `backend`: NCCL's own log, where it is not on yet."""
    if backend != "nccl" or environ.get("NCCL_DEBUG", "").upper() in ("INFO", "TRACE"):
        return ""
    return (
        "To see which interface and transport NCCL chose, and where it stopped, rerun with "
        "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET."
    )


def network_interfaces() -> list[str]:
    """This node's interfaces with an IP address (the ones NCCL and gloo can use)."""
    ip = (socket.AF_INET, socket.AF_INET6)
    return sorted(
        name for name, addresses in psutil.net_if_addrs().items() if any(a.family in ip for a in addresses)
    )


def print_network_warnings(backend: str, nproc: int, nnodes: int, endpoint: str = "") -> None:
    """`network_warnings` for this node (and `endpoint_warning`), on standard error, before a launch."""
    warnings = network_warnings(os.environ, backend, nproc, nnodes, network_interfaces())
    for warning in [*warnings, endpoint_warning(endpoint, nnodes)]:
        if warning:
            print(f"distft: warning: {warning}", file=sys.stderr)
