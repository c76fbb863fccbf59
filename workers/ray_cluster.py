"""Joining a Ray cluster (or starting a private one on loopback) and the device its ranks get."""
from __future__ import annotations

import os
import socket

import ray
from ray._private.authentication.authentication_token_setup import (ensure_token_if_auth_enabled,
                                                                    maybe_enable_token_auth_if_token_available)
from ray._private.services import canonicalize_bootstrap_address
from ray._raylet import InnerGcsClient
from ray.exceptions import AuthenticationError, RpcError

_CLUSTER_ANSWER_TIMEOUT_S = 10.0
_TOKEN_HELP = ("set RAY_AUTH_MODE=token and give this machine the cluster's token: copy the head node's "
               "~/.ray/auth_token to ~/.ray/auth_token here, or point RAY_AUTH_TOKEN_PATH at a copy, or put the token "
               "itself in RAY_AUTH_TOKEN")

def cluster_device(device: str, num_ranks: int) -> str:
    """'auto' → 'cuda' when the cluster has GPUs, else 'cpu'; 'cuda' without a GPU per rank is refused now
    rather than after a placement timeout."""
    num_gpus = int(ray.cluster_resources().get("GPU", 0))
    if device == "auto":
        device = "cuda" if num_gpus else "cpu"
    if device == "cuda" and num_gpus < num_ranks:
        raise ValueError(f"device='cuda' with {num_ranks} ranks needs {num_ranks} GPUs; the Ray cluster has "
                         f"{num_gpus}")
    return device


def connect_ray(address: str | None, num_ranks: int) -> None:
    """Join the cluster at `address`, or start a private single-node Ray on loopback with a CPU per rank."""
    if address is not None:
        _check_cluster_answers(address)
        ray.init(address=address)
        return
    ray.init(address="local", num_cpus=max(num_ranks, os.cpu_count() or 1), include_dashboard=False,
             _node_ip_address="127.0.0.1")


def _check_cluster_answers(address: str) -> None:
    """ValueError, within seconds, where ray.init would retry for a minute or more: nothing answers at `address`,
    or the cluster refuses this process's token (Ray 2.52+ clusters may require one). The address and the token
    are resolved as ray.init resolves them."""
    gcs_address = canonicalize_bootstrap_address(address)
    if gcs_address is None:
        return  # 'auto' and no cluster started on this machine: ray.init says so at once
    if address == "auto":  # as in ray.init: a cluster found on this machine turns token auth on if a token is here
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    host, port = gcs_address.rsplit(":", 1)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_CLUSTER_ANSWER_TIMEOUT_S).close()
    except OSError as error:
        raise ValueError(f"ray_address={address}: nothing answers at {gcs_address} ({error}); start the cluster "
                         "with `ray start --head`, or pass its head node's HOST:PORT") from error
    try:
        ensure_token_if_auth_enabled(None, create_token_if_missing=False)
        InnerGcsClient.standalone(gcs_address, None, int(_CLUSTER_ANSWER_TIMEOUT_S * 1000))
    except AuthenticationError as error:
        reason = error.message.split(". ")[0]  # the rest is Ray's generic advice, which _TOKEN_HELP replaces
        raise ValueError(f"ray_address={address}: this process cannot authenticate to the Ray cluster at "
                         f"{gcs_address} ({reason}); {_TOKEN_HELP}") from error
    except RpcError as error:
        raise ValueError(f"ray_address={address}: {gcs_address} did not answer as a Ray cluster's head within "
                         f"{_CLUSTER_ANSWER_TIMEOUT_S:.0f} s ({error})") from error
