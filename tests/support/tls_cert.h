// A self-signed TLS certificate for tests, made fresh by the openssl command-line tool (package openssl):
// an EC P-256 key and a certificate for CN=localhost, valid for 127.0.0.1 and localhost, one day.
#pragma once

#include <string>

namespace numoe::test {

struct TestCertificate {
  std::string cert;  // path of the PEM certificate (also the CA file a client trusts)
  std::string key;   // path of the PEM private key
  std::string error; // "" = made; else why not (openssl missing or failed)
};

// Writes <dir>/<name>.crt and <dir>/<name>.key.
TestCertificate MakeTestCertificate(const std::string& dir, const std::string& name = "server");

}  // namespace numoe::test
