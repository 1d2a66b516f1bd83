"""The media URLs a client puts in a request (an image's `url`), checked before any backend sees them.

The gateway never fetches them, but a backend may: a vendor fetches from the internet, under its own
rules, while a self-hosted OpenAI-compatible server (vLLM, SGLang) fetches from inside the operator's
network, where a tenant's `http://169.254.169.254/...` reaches the cloud's metadata service (its
instance credentials) and `http://127.0.0.1:...` the server's own host. No vendor can fetch those
addresses for a legitimate request, so they are refused for every backend: hosts that are loopback,
link-local or unspecified addresses, in any spelling a fetcher's resolver takes (`2852039166`,
`0xa9.0xfe.0xa9.0xfe`, `[::ffff:169.254.169.254]`), the cloud metadata services' own addresses and
names, `localhost`, and `file:` URLs. Private ranges (10/8...) are not refused: an operator's own
backend may fetch images from its own network. A host name that resolves to such an address is not
caught here (the gateway resolves nothing): restrict what a self-hosted backend may fetch there.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from urllib.parse import urlsplit

from gateway.errors import InvalidRequest
from gateway.types import ChatRequest, ImagePart

# Metadata services outside the link-local range: Alibaba Cloud's, and AWS's over IPv6 (a ULA).
_METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in ("100.100.100.200", "fd00:ec2::254"))
_METADATA_NAMES = frozenset({"metadata", "metadata.google.internal", "instance-data", "localhost"})
# What inet_aton (which resolvers use for a numeric host) reads as IPv4: 1 to 4 parts, each decimal,
# octal or hex (`2852039166`, `0251.0376.0251.0376`, `169.254.43518`).
_NUMERIC_IPV4 = re.compile(r"^(?:0x[0-9a-f]*|[0-9]+)(?:\.(?:0x[0-9a-f]*|[0-9]+)){0,3}$")


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if not _NUMERIC_IPV4.match(host):
            return None
        try:
            address = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def refused_host(url: str) -> str | None:
    """Why no backend may be asked to fetch `url`, or None when one may."""
    try:
        parts = urlsplit(url.strip())
        host = (parts.hostname or "").rstrip(".")
    except ValueError:  # an unbalanced bracket in the host: no fetcher reads it either
        return None
    scheme = parts.scheme.lower()
    if scheme == "file":
        return "a file: URL"
    if scheme == "data":
        return None
    if host in _METADATA_NAMES or host.endswith(".localhost"):
        return f"host {host}"
    address = _address(host.split("%", 1)[0])  # an IPv6 zone is no part of the address
    if address is None:
        return None
    if (
        address.is_loopback
        or address.is_link_local
        or address.is_unspecified
        or address in _METADATA_ADDRESSES
    ):
        return f"address {address}"
    return None


def check_media_urls(request: ChatRequest) -> None:
    """400 for the first image URL of `request` no backend may be asked to fetch."""
    for i, message in enumerate(request.messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if isinstance(part, ImagePart) and (why := refused_host(part.image_url.url)) is not None:
                raise InvalidRequest(
                    f"Image URLs must not point at {why}: a loopback, link-local, metadata or local "
                    "address, which a backend would fetch from inside the gateway's network.",
                    param=f"messages[{i}].content[{j}].image_url.url",
                    code="invalid_image_url",
                )
