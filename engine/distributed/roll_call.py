"""The start-up roll call: every process reports to process 0 before jax.distributed starts.

jax.distributed's own start-up waits `initialization_timeout_s` for all processes and then aborts
without saying which one is missing. With an explicit coordinator this roll call comes first,
over TCP on the coordinator's port + 1, and names the processes that did not start.

Security model (docs/multihost.md): process 0 listens only on the coordinator's own address
(the host of --coordinator_address, resolved), never on every interface. Every process holds a
run key: from ENGINE_RUN_TOKEN (a secret; launch/local.py gives every process the same random
one) or, where none is set, derived from the port and the process count, which keeps out port
scanners, stray clients and other runs but not someone who reads this file: without a token,
processes start only where the coordinator is a loopback address (one machine). Process 0 sends
each connection a fresh nonce; a process answers with its index and an HMAC of both nonces, so
the key never crosses the wire and an answer cannot be replayed; process 0's final answer carries
an HMAC too, so a process trusts only the real process 0. A connection that does not complete a
valid check-in within HANDSHAKE_S, sends more than MAX_LINE bytes without a newline, or names an
index out of range or already taken is dropped without touching the roll call.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import hmac
import ipaddress
import os
import secrets
import selectors
import socket
import time

from absl import logging

TOKEN_VARIABLE = 'ENGINE_RUN_TOKEN'
GREETING = 'engine-roll-call/1'
MAX_LINE = 256  # Bytes; every line of the protocol is well under it.
HANDSHAKE_S = 5.0  # Each connection's time to check in, whatever it sends meanwhile.
MAX_PENDING = 64  # Connections still checking in; beyond it the oldest is dropped.


class PeerMissingError(RuntimeError):
  """A process of the run did not start (or cannot reach process 0) in time."""


def run_key(port: int, num_processes: int, token: str | None = None) -> bytes:
  """The HMAC key of the roll call: from `token` (else ENGINE_RUN_TOKEN), or derived."""
  token = token if token is not None else os.environ.get(TOKEN_VARIABLE, '')
  if token:
    return hashlib.sha256(f'engine run token|{token}'.encode()).digest()
  # Not a secret: it separates runs and keeps out what does not speak the protocol.
  return hashlib.sha256(f'engine roll call|port={port}|processes={num_processes}'.encode()).digest()


def mac(key: bytes, *parts) -> str:
  return hmac.new(key, '|'.join(map(str, parts)).encode(), hashlib.sha256).hexdigest()


def _same(proof: str, expected: str) -> bool:
  # As bytes: compare_digest refuses str with non-ASCII characters, which a stranger may send.
  return hmac.compare_digest(proof.encode(), expected.encode())


# A refusal carries a code, not text: it is not authenticated, so the process words it itself.
_REFUSALS = {
    'token': 'its run key differs from process 0\'s; start every process with the same '
             f'{TOKEN_VARIABLE} (python -m launch.local gives all the same one) or all without '
             'one, and with the same --num_processes',
    'range': 'process 0 runs {n} processes, numbered 0 to {n_1}; start every process with the '
             'same --num_processes',
    'taken': 'another process already reported as process {index}; give every process its own '
             '--process_id',
}


def await_peers(coordinator_address: str, num_processes: int, process_id: int,
                timeout_s: float, token: str | None = None) -> None:
  """Waits until every process has started, naming the ones that have not after `timeout_s`;
  process 0 answers all of them once everyone is there, or names the missing indices (to them
  and in its own error). `token` defaults to ENGINE_RUN_TOKEN."""
  host, port = coordinator_address.rsplit(':', 1)
  host, port = host.strip('[]'), int(port)
  token = token if token is not None else os.environ.get(TOKEN_VARIABLE, '')
  if not token and not _is_loopback(host):
    # The derived key is no secret: a stranger who computes it would be admitted as a process.
    raise ValueError(
        f'--coordinator_address={coordinator_address} reaches beyond this machine, and '
        f'{TOKEN_VARIABLE} is not set, so any process that knows the protocol could join the run; '
        f'export the same secret in every process (export {TOKEN_VARIABLE}=$(python -c "import '
        'secrets; print(secrets.token_hex(32))"), shared with every host), or start the '
        'processes with python -m launch.local.')
  key = run_key(port, num_processes, token)
  deadline = time.monotonic() + timeout_s
  if process_id == 0:
    _call_the_roll(_listen(host, port), key, num_processes, deadline, timeout_s)
    return
  while True:
    try:
      with socket.create_connection((host, port + 1),
                                    timeout=max(deadline - time.monotonic(), 0.1)) as s:
        reply = _check_in(s, key, process_id, f'{host}:{port}', timeout_s)
      break
    except OSError:  # Process 0 not listening yet, or it went away.
      if time.monotonic() > deadline:
        raise PeerMissingError(
            f'process 0 (the coordinator, {host}:{port}) did not answer process {process_id} '
            f'within {timeout_s:g} s; start it, or check --coordinator_address.') from None
      time.sleep(0.2)
  if reply != 'all here':
    raise PeerMissingError(f'{reply}; process {process_id} stops too.')


def _read_line(s: socket.socket, received: bytearray, deadline: float) -> str:
  """The next line of at most MAX_LINE bytes by `deadline` (`received` keeps what came after
  it); OSError if the peer is gone or too slow."""
  while b'\n' not in received:
    if len(received) > MAX_LINE:
      raise ConnectionError('line too long')
    s.settimeout(max(deadline - time.monotonic(), 0.01))
    chunk = s.recv(MAX_LINE + 1 - len(received))
    if not chunk:
      raise ConnectionError('closed')
    received += chunk
  line, _, rest = bytes(received).partition(b'\n')
  received[:] = rest
  return line.decode('ascii', 'replace')


def _check_in(s: socket.socket, key: bytes, index: int, coordinator: str,
              timeout_s: float) -> str:
  """A process's side: proves the run key to process 0 and checks its answer's proof."""
  received = bytearray()
  greeting = _read_line(s, received, time.monotonic() + HANDSHAKE_S).split(' ')
  def not_process_0(why):
    return PeerMissingError(
        f'what answers on the coordinator\'s port + 1 ({coordinator} + 1) is not process 0 of '
        f'this run ({why}); check --coordinator_address, and that nothing else listens on the '
        'port after it.')

  if len(greeting) != 2 or greeting[0] != GREETING:
    raise not_process_0('it does not speak the roll call')
  nonce, own = greeting[1][:64], secrets.token_hex(16)
  s.sendall(f'{index} {own} {mac(key, "check-in", nonce, index, own)}\n'.encode())
  # Process 0 started before this connection, so it answers within its timeout.
  reply = _read_line(s, received, time.monotonic() + timeout_s + HANDSHAKE_S)
  word, _, rest = reply.partition(' ')
  if word == 'refused':
    code, _, n = rest.partition(' ')
    n = int(n) if n.isdigit() and len(n) < 9 else 0
    reason = _REFUSALS.get(code, 'for a reason this process does not know (another version of '
                           'the engine?); check process 0\'s output')
    raise PeerMissingError(f'process 0 (the coordinator, {coordinator}) refused process {index}: '
                           + reason.format(index=index, n=n, n_1=n - 1) + '.')
  if not _same(word, mac(key, 'answer', nonce, own, index, rest)):
    raise not_process_0('its answer does not prove the run token')
  return rest


@dataclasses.dataclass
class _Pending:
  nonce: str
  expires: float
  received: bytes = b''


def _is_loopback(host: str) -> bool:
  """Whether every address `host` resolves to is this machine's loopback (an unresolvable host
  counts as one: process 0 names it in its own error, and no stranger reaches it)."""
  try:
    addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
  except socket.gaierror:
    return True
  return all(ipaddress.ip_address(a.split('%')[0]).is_loopback for a in addresses)


def _listen(host: str, port: int) -> socket.socket:
  """Process 0's listening socket on the coordinator's address (not every interface)."""
  try:
    family, _, _, _, address = socket.getaddrinfo(host, port + 1, type=socket.SOCK_STREAM)[0]
  except socket.gaierror as error:
    raise PeerMissingError(
        f'process 0 cannot resolve {host}, the host of --coordinator_address ({error.strerror}); '
        'give a name or address of process 0\'s machine.') from None
  try:
    server = socket.create_server(address, family=family)
  except OSError as error:
    if error.errno == errno.EADDRNOTAVAIL:
      raise PeerMissingError(
          f'--coordinator_address host {host} ({address[0]}) is not an address of process 0\'s '
          'machine, and process 0 is the coordinator; give one of its own names or addresses '
          '(one the other processes reach it by).') from None
    raise PeerMissingError(
        f'process 0 cannot listen on {address[0]} port {port + 1} (the coordinator\'s port + 1) '
        f'to see that every process started: {error.strerror}; choose a --coordinator_address '
        'port whose next port is free too.') from None
  return server


class _Roll:
  """Process 0's side: check-ins over non-blocking sockets, each bounded in bytes and time."""

  def __init__(self, key: bytes, num_processes: int):
    self.key, self.n = key, num_processes
    self.present = {}  # index -> (socket, process 0's nonce, the process's nonce)
    self.pending = {}  # socket -> _Pending
    self.refused_tokens = 0
    self.selector = selectors.DefaultSelector()

  def accept(self, server: socket.socket, deadline: float) -> None:
    try:
      conn, _ = server.accept()
    except OSError:
      return
    if len(self.pending) >= MAX_PENDING:  # A flood: the oldest goes first.
      self.drop(min(self.pending, key=lambda c: self.pending[c].expires))
    pending = _Pending(secrets.token_hex(16), min(time.monotonic() + HANDSHAKE_S, deadline))
    try:
      conn.setblocking(False)
      conn.send(f'{GREETING} {pending.nonce}\n'.encode())  # Fits any fresh send buffer.
    except OSError:
      conn.close()
      return
    self.pending[conn] = pending
    self.selector.register(conn, selectors.EVENT_READ)

  def drop(self, conn: socket.socket, refusal: str | None = None) -> None:
    self.selector.unregister(conn)
    del self.pending[conn]
    if refusal:
      try:
        conn.send(f'refused {refusal}\n'.encode())
      except OSError:
        pass
    conn.close()

  def expire(self, now: float) -> None:
    for conn in [c for c, p in self.pending.items() if p.expires <= now]:
      self.drop(conn)

  def read(self, conn: socket.socket) -> None:
    pending = self.pending[conn]
    try:
      chunk = conn.recv(MAX_LINE + 1 - len(pending.received))
    except (BlockingIOError, InterruptedError):
      return
    except OSError:
      chunk = b''
    pending.received += chunk
    if not chunk or (b'\n' not in pending.received and len(pending.received) > MAX_LINE):
      self.drop(conn)
    elif b'\n' in pending.received:
      self.check(conn, pending, pending.received.split(b'\n', 1)[0])

  def check(self, conn: socket.socket, pending: _Pending, line: bytes) -> None:
    """One check-in line, `INDEX NONCE HMAC`: taken if the proof, the range and the slot hold."""
    fields = line.decode('ascii', 'replace').split(' ')
    if (len(fields) != 3 or not fields[0].isascii() or not fields[0].lstrip('-').isdigit()
        or len(fields[1]) > 64):
      self.drop(conn)  # Not the protocol: a stranger.
      return
    index, nonce, proof = int(fields[0]), fields[1], fields[2]
    if not _same(proof, mac(self.key, 'check-in', pending.nonce, index, nonce)):
      self.refused_tokens += 1
      logging.warning('roll call: refused a check-in as process %d with another run token', index)
      self.drop(conn, 'token')
    elif not 1 <= index < self.n:
      logging.warning('roll call: refused process %d of %d', index, self.n)
      self.drop(conn, f'range {self.n}')
    elif index in self.present:
      logging.warning('roll call: refused a second process %d', index)
      self.drop(conn, 'taken')
    else:
      self.selector.unregister(conn)
      del self.pending[conn]
      self.present[index] = (conn, pending.nonce, nonce)

  def answer(self, message: str) -> None:
    for index, (conn, nonce, theirs) in self.present.items():
      with conn:
        try:
          conn.settimeout(2)
          conn.sendall(f'{mac(self.key, "answer", nonce, theirs, index, message)} {message}\n'
                       .encode())
        except OSError:
          pass  # That process is gone; its own error or the runtime's names it.
    for conn in list(self.pending):
      self.drop(conn)
    self.selector.close()


def _call_the_roll(server: socket.socket, key: bytes, num_processes: int, deadline: float,
                   timeout_s: float) -> None:
  """Process 0's side of `await_peers`, on its listening socket `server`."""
  roll = _Roll(key, num_processes)
  with server:
    server.setblocking(False)
    roll.selector.register(server, selectors.EVENT_READ)
    while len(roll.present) < num_processes - 1:
      now = time.monotonic()
      roll.expire(now)
      if now >= deadline:
        break
      wake = min([deadline] + [p.expires for p in roll.pending.values()])
      for ready, _ in roll.selector.select(timeout=max(wake - now, 0.001)):
        if ready.fileobj is server:
          roll.accept(server, deadline)
        elif ready.fileobj in roll.pending:
          roll.read(ready.fileobj)
    roll.selector.unregister(server)
  missing = sorted(set(range(1, num_processes)) - set(roll.present))
  message = 'all here' if not missing else (
      f'process{"es" if len(missing) > 1 else ""} {", ".join(map(str, missing))} of '
      f'{num_processes} did not start within {timeout_s:g} s (--heartbeat_timeout_s)')
  roll.answer(message)
  if missing:
    refused = roll.refused_tokens
    note = (f', and {refused} check-in{"s" if refused > 1 else ""} with another run token '
            f'{"were" if refused > 1 else "was"} refused' if refused else '')
    raise PeerMissingError(f'{message}{note}; start {"them" if len(missing) > 1 else "it"} with '
                           f'the same --coordinator_address and {TOKEN_VARIABLE}, or check the '
                           'hosts they run on.')
