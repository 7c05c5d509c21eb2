#include "router/http/tls.h"

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <fstream>
#include <memory>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace numoe::router {
namespace {

std::string OpenSslError() {
  unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "no PEM data found";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof(buf));
  return buf;
}

StatusOr<std::string> ReadPemFile(const std::string& flag, const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": cannot open the file"));
  std::stringstream ss;
  ss << f.rdbuf();
  if (f.bad()) return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": cannot read the file"));
  std::string text = ss.str();
  if (text.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": the file is empty"));
  return text;
}

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};

std::unique_ptr<BIO, BioFree> MemBio(const std::string& text) {
  return std::unique_ptr<BIO, BioFree>(BIO_new_mem_buf(text.data(), static_cast<int>(text.size())));
}

}  // namespace

StatusOr<TlsPem> LoadTlsPem(const std::string& cert_path, const std::string& key_path) {
  if (cert_path.empty() && key_path.empty()) return TlsPem{};
  if (cert_path.empty()) return absl::InvalidArgumentError("--tls-key needs --tls-cert (the certificate's PEM file)");
  if (key_path.empty()) return absl::InvalidArgumentError("--tls-cert needs --tls-key (the private key's PEM file)");
  TlsPem pem;
  ASSIGN_OR_RETURN(pem.cert_chain, ReadPemFile("--tls-cert", cert_path));
  ASSIGN_OR_RETURN(pem.private_key, ReadPemFile("--tls-key", key_path));

  ERR_clear_error();
  auto cert_bio = MemBio(pem.cert_chain);
  std::unique_ptr<X509, X509Free> cert(PEM_read_bio_X509(cert_bio.get(), nullptr, nullptr, nullptr));
  if (!cert) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-cert ", cert_path, ": not a PEM certificate (", OpenSslError(), ")"));
  }
  auto key_bio = MemBio(pem.private_key);
  // An empty passphrase callback: an encrypted key fails here instead of prompting on the terminal.
  std::unique_ptr<EVP_PKEY, KeyFree> key(PEM_read_bio_PrivateKey(
      key_bio.get(), nullptr, [](char*, int, int, void*) { return 0; }, nullptr));
  if (!key) {
    return absl::InvalidArgumentError(absl::StrCat("--tls-key ", key_path,
                                                   ": not an unencrypted PEM private key (", OpenSslError(), ")"));
  }
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat("--tls-key ", key_path, ": the key does not match the certificate in --tls-cert ",
                                                   cert_path));
  }
  return pem;
}

}  // namespace numoe::router
