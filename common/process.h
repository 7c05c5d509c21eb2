// Process plumbing every numoe daemon shares: the readiness notification that `numoe serve` waits for,
// and shutdown on SIGINT/SIGTERM.
#pragma once

#include <functional>
#include <string>

namespace numoe {

// When the environment variable NUMOE_NOTIFY_FD names an open file descriptor (set by `numoe serve`),
// writes "READY <text>\n" to it and closes it. No-op otherwise.
void NotifyReady(const std::string& text);

// Blocks SIGINT/SIGTERM in this thread; call before starting other threads, so they inherit the mask and
// the signals wait for WaitForShutdownSignal.
void BlockShutdownSignals();
// Returns the signal number once SIGINT or SIGTERM arrives, or 0 as soon as `give_up()` turns true
// (polled every `poll_ms`; nullptr = never).
int WaitForShutdownSignal(const std::function<bool()>& give_up = nullptr, int poll_ms = 200);

}  // namespace numoe
