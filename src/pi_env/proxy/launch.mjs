// Starts an agent that cannot preload forward.mjs (a native binary, a Python CLI) behind the same
// forwarder: `node launch.mjs PROGRAM ARGS...`. The forwarder listens first (its top-level await),
// then PROGRAM runs as this process's child with its stdio; node exits with the child's status.
// The forwarder's server is unref'd, so only the running child keeps node alive.
import { spawn } from "node:child_process";
import { constants } from "node:os";
import "./forward.mjs";

const [program, ...args] = process.argv.slice(2);
const child = spawn(program, args, { stdio: "inherit" });
for (const signal of ["SIGTERM", "SIGINT", "SIGHUP"]) {
  process.on(signal, () => child.kill(signal));
}
child.on("error", (error) => {
  console.error(`pi-env launcher: cannot start ${program}: ${error.message}`);
  process.exit(127);
});
child.on("exit", (code, signal) => {
  process.exit(code ?? 128 + (constants.signals[signal] || 0));
});
