"""The engine side of hisparse: ``attach()`` a namespace of the node's daemon.

    from hisparse import client
    c = client.attach(namespace="glm-5.3/fp8_ds_mla/tp8", layout=layout)
    n = c.lookup(keys); c.store(keys, pages); c.load(keys, out)
    with c.pin(keys) as p: p.view(0)

torch is imported inside the functions that need it, never torch.cuda at
import time: the CUDA backend loads on the first CUDA tensor it is given.
"""

from __future__ import annotations

from hisparse.client.client import Client, ClientSession, attach
from hisparse.client.keys import KeyTypeError
from hisparse.client.pins import Pin
from hisparse.client.results import StoreResult
from hisparse.client.transport import default_socket_path

__all__ = ["Client", "ClientSession", "KeyTypeError", "Pin", "StoreResult", "attach", "default_socket_path"]
