// Ports for local daemons, chosen before they start (`numoe serve` picks its children's ports once, so a
// restarted child comes back where its peers expect it; tests and benchmarks do the same).
//
// The kernel's bind(0) is not enough for that: the port is released before the daemon binds it, and in the
// meantime the kernel may hand the same port to another process's bind(0) or use it as a connect() source
// port. So ports come from below the ephemeral range (/proc/sys/net/ipv4/ip_local_port_range), where the
// kernel never picks on its own; a port must bind on all addresses right now (nothing listens on it and no
// TIME_WAIT holds it); and it must not have been handed to any caller on this machine in the last
// kReservedSeconds, which a registry file records ($TMPDIR or /tmp, numoe-ports-<uid>, under flock).
#pragma once

#include "common/status.h"

namespace numoe {

inline constexpr int kReservedSeconds = 600;

// One free port (see above).
StatusOr<int> ReserveLocalPort();
// `n` consecutive free ports; returns the first (daemon i listens on first + i).
StatusOr<int> ReserveLocalPorts(int n);

}  // namespace numoe
