#include "tests/support/tls_cert.h"

#include <filesystem>

#include "tests/support/process.h"

namespace numoe::test {

TestCertificate MakeTestCertificate(const std::string& dir, const std::string& name) {
  TestCertificate c;
  c.cert = dir + "/" + name + ".crt";
  c.key = dir + "/" + name + ".key";
  std::string openssl;
  for (const char* p : {"/usr/bin/openssl", "/usr/local/bin/openssl"}) {
    if (std::filesystem::exists(p)) {
      openssl = p;
      break;
    }
  }
  if (openssl.empty()) {
    c.error = "the openssl command is not installed (Debian package openssl)";
    return c;
  }
  RunResult r = RunCommand({openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                            "-nodes", "-days", "1", "-subj", "/CN=localhost", "-addext",
                            "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", c.key, "-out", c.cert},
                           {.merge_stderr = true});
  if (r.rc != 0) c.error = "openssl req failed: " + r.out;
  return c;
}

}  // namespace numoe::test
