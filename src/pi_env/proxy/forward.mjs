// Preloaded into the agent's node process (`node --import forward.mjs cli.js ...`).
//
// The sandbox has no network, only the gateway's Unix socket; the Pi CLI only speaks HTTP to a
// host:port. This listens on 127.0.0.1:PI_ENV_GATEWAY_PORT and pipes every connection to a
// fresh connection to PI_ENV_GATEWAY_SOCKET, so Pi's baseUrl is http://127.0.0.1:PORT/v1.
//
// It must never keep node alive: the server and every socket are unref'd, so the process exits
// when the CLI is done (the CLI's own pending requests keep it alive while they run).
import net from "node:net";

const socketPath = process.env.PI_ENV_GATEWAY_SOCKET || "/run/pi-env/gateway.sock";
const port = Number(process.env.PI_ENV_GATEWAY_PORT || 11434);

// Sent when the gateway socket cannot be reached at all: an explicit HTTP error puts the reason
// in the agent's record, where a reset connection would not (and Node 20's fetch retries a
// connection reset before its request was written again and again).
function gatewayUnreachable(error) {
  const body = JSON.stringify({
    error: {
      message: `pi-env forwarder: gateway socket ${socketPath} unreachable: ${error.code || error.message}`,
      type: "gateway_unreachable",
    },
  });
  return (
    "HTTP/1.1 502 Bad Gateway\r\nContent-Type: application/json\r\n" +
    `Content-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`
  );
}

// Remote sandboxes (pi_env.sandbox.remote) have no socket of the host's: PI_ENV_GATEWAY_URL is the
// host gateway's authenticated URL, reached over the sandbox's network. HTTP is proxied request by
// request (not piped as bytes) so a reverse proxy in front of the gateway sees its own Host; the
// agent still holds only its per-session token, the upstream key stays on the host.
const gatewayUrl = process.env.PI_ENV_GATEWAY_URL ? new URL(process.env.PI_ENV_GATEWAY_URL) : null;
const client = gatewayUrl ? await import(gatewayUrl.protocol === "https:" ? "node:https" : "node:http") : null;
const { createServer } = await import("node:http");

function proxyRequest(req, res) {
  const upstream = client.request(
    {
      protocol: gatewayUrl.protocol,
      hostname: gatewayUrl.hostname,
      port: gatewayUrl.port,
      method: req.method,
      path: gatewayUrl.pathname.replace(/\/$/, "") + req.url,
      headers: { ...req.headers, host: gatewayUrl.host },
      agent: false, // one connection per request: nothing idle keeps node alive
    },
    (answer) => {
      res.writeHead(answer.statusCode, answer.headers);
      answer.pipe(res);
    },
  );
  upstream.on("socket", (socket) => socket.unref());
  upstream.on("error", (error) => {
    if (res.headersSent) {
      res.destroy();
      return;
    }
    const body = JSON.stringify({
      error: {
        message: `pi-env forwarder: gateway ${gatewayUrl.origin} unreachable: ${error.code || error.message}`,
        type: "gateway_unreachable",
      },
    });
    res.writeHead(502, { "Content-Type": "application/json", Connection: "close" });
    res.end(body);
  });
  req.pipe(upstream);
}

const server = gatewayUrl ? createServer(proxyRequest) : net.createServer((client) => {
  const gateway = net.connect(socketPath);
  client.unref();
  gateway.unref();
  let connected = false;
  gateway.once("connect", () => {
    connected = true;
  });
  // Once connected, an error on either side destroys both, so the agent sees a broken
  // connection, never a hang; pipe() passes a clean end (FIN) on after flushing.
  client.on("error", () => {
    client.destroy();
    gateway.destroy();
  });
  gateway.on("error", (error) => {
    gateway.destroy();
    if (connected) {
      client.destroy();
    } else {
      client.resume(); // drain the request: closing with unread bytes would reset, not answer
      client.end(gatewayUnreachable(error));
    }
  });
  client.pipe(gateway);
  gateway.pipe(client);
});
server.unref();
server.on("connection", (socket) => socket.unref());

// Wait until listening (top-level await) so the CLI's first request cannot race the bind. A
// failed listen is ignored: EADDRINUSE means another node process of this agent (a child that
// inherited the preload) already forwards this port.
await new Promise((resolve) => {
  server.once("error", resolve);
  server.listen(port, "127.0.0.1", resolve);
});
