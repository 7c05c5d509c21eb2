// The JSON machine description: what it accepts, and errors that name the field.
#include "common/topology.h"

#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/files.h"
#include "tests/support/status_matchers.h"

namespace numoe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string ErrorOf(const std::string& text) {
  auto t = ParseTopologyJson(text, "m.json");
  EXPECT_FALSE(t.ok()) << "accepted: " << text;
  return t.ok() ? "" : std::string(t.status().message());
}

TEST(TopologyJson, AcceptsCountsListsAndRanges) {
  auto t = ParseTopologyJson(R"({"name": "box", "nodes": [
      {"id": 0, "cpus": 24, "memory_gb": 192, "dimms": 6},
      {"id": 1, "cpus": [24, 25, 26, 27], "memory_gb": 191.5, "cores": 2, "available_gb": 100},
      {"id": 3, "cpus": "28-31,60-63", "memory_gb": 160}],
      "distances": [[10, 21, 21], [21, 10, 21], [21, 21, 10]]})",
                             "m.json");
  ASSERT_OK(t);
  EXPECT_EQ(t->name, "box");
  ASSERT_EQ(t->nodes.size(), 3u);
  EXPECT_EQ(t->nodes[0].num_cpus, 24);
  EXPECT_TRUE(t->nodes[0].cpu_ids.empty());
  EXPECT_EQ(t->nodes[0].memory_bytes, 192'000'000'000);
  EXPECT_EQ(t->nodes[0].dimms, 6);
  EXPECT_EQ(t->nodes[0].available_bytes, -1);
  EXPECT_THAT(t->nodes[1].cpu_ids, ElementsAre(24, 25, 26, 27));
  EXPECT_EQ(t->nodes[1].memory_bytes, 191'500'000'000);
  EXPECT_EQ(t->nodes[1].cores, 2);
  EXPECT_EQ(t->nodes[1].available_bytes, 100'000'000'000);
  EXPECT_EQ(t->nodes[2].id, 3);
  EXPECT_EQ(t->nodes[2].num_cpus, 8);
  EXPECT_EQ(FormatCpuList(t->nodes[2].cpu_ids), "28-31,60-63");
  EXPECT_EQ(t->IndexOf(3), 2);
  EXPECT_EQ(t->IndexOf(2), -1);
  EXPECT_EQ(t->Distance(0, 1), 21);
}

TEST(TopologyJson, NameDefaultsToSourceAndDistancesDefault) {
  auto t = ParseTopologyJson(R"({"nodes": [{"id": 0, "cpus": 2, "memory_gb": 8}, {"id": 1, "cpus": 2, "memory_gb": 8},
                                           {"id": 2, "cpus": 2, "memory_gb": 8}]})",
                             "m.json");
  ASSERT_OK(t);
  EXPECT_EQ(t->name, "m.json");
  EXPECT_EQ(t->Distance(1, 1), 10);
  EXPECT_LT(t->Distance(0, 1), t->Distance(0, 2));  // neighbours by id pair first
}

TEST(TopologyJson, ErrorsNameTheField) {
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": 4, "memory_gb": 8}, {"id": 1, "cpus": 4, "memory_gb": 8},
                                    {"id": 2, "cpus": 4, "memory_gb": -1}]})"),
              HasSubstr("m.json: nodes[2].memory_gb must be > 0 (got -1)"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": 4, "memory_gb": 0}]})"),
              HasSubstr("nodes[0].memory_gb must be > 0"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": 4, "memory_gb": "192"}]})"),
              HasSubstr("nodes[0].memory_gb must be a number of GB (got string)"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": 4, "memory_gb": 192000000000}]})"),
              HasSubstr("nodes[0].memory_gb must be <= 1e+06 GB"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": 4}]})"), HasSubstr("nodes[0].memory_gb is missing"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"cpus": 4, "memory_gb": 8}]})"), HasSubstr("nodes[0].id is missing"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "memory_gb": 8}]})"), HasSubstr("nodes[0].cpus is missing"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": 0, "memory_gb": 8}]})"),
              HasSubstr("nodes[0].cpus must be >= 1 (got 0)"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": 2.5, "memory_gb": 8}]})"),
              HasSubstr("nodes[0].cpus must be an integer (got 2.5)"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": true, "memory_gb": 8}]})"),
              HasSubstr("nodes[0].cpus must be a CPU count, a list of CPU ids or a string"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": [], "memory_gb": 8}]})"),
              HasSubstr("nodes[0].cpus must list at least one CPU"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": [1, 2, 1], "memory_gb": 8}]})"),
              HasSubstr("nodes[0].cpus lists CPU 1 twice"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": [1, -2], "memory_gb": 8}]})"),
              HasSubstr("nodes[0].cpus[1] must be >= 0 (got -2)"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": "0-3,x", "memory_gb": 8}]})"),
              HasSubstr("nodes[0].cpus must look like \"0-23,48-71\": \"x\" is not a CPU id"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": "5-3", "memory_gb": 8}]})"),
              HasSubstr("\"5-3\" is not a range lo-hi"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": [0, 1], "memory_gb": 8}, {"id": 1, "cpus": [1, 2], "memory_gb": 8}]})"),
              HasSubstr("nodes[1].cpus lists CPU 1, which nodes[0] also lists"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": 2, "memory_gb": 8}, {"id": 0, "cpus": 2, "memory_gb": 8}]})"),
              HasSubstr("nodes[1].id repeats node id 0 of nodes[0]"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": -1, "cpus": 2, "memory_gb": 8}]})"), HasSubstr("nodes[0].id must be >= 0"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": 2, "memory_gb": 8, "cores": 3}]})"),
              HasSubstr("nodes[0].cores must be <= 2 (got 3)"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": 2, "memory_gb": 8, "dimms": 0}]})"),
              HasSubstr("nodes[0].dimms must be >= 1"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": 2, "memory_gb": 8, "available_gb": 9}]})"),
              HasSubstr("nodes[0].available_gb must be <= memory_gb"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": 2, "memory": 8}]})"),
              HasSubstr("nodes[0].memory is not a known key"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [3]})"), HasSubstr("nodes[0] must be an object (got number)"));
  EXPECT_THAT(ErrorOf(R"({"nodes": []})"), HasSubstr("m.json: nodes must list at least one NUMA node"));
  EXPECT_THAT(ErrorOf(R"({"nodes": {}})"), HasSubstr("nodes must be an array (got object)"));
  EXPECT_THAT(ErrorOf(R"({"name": "x"})"), HasSubstr("nodes is missing"));
  EXPECT_THAT(ErrorOf(R"({"name": 5, "nodes": []})"), HasSubstr("name must be a string (got number)"));
  EXPECT_THAT(ErrorOf(R"({"nodez": []})"), HasSubstr("nodez is not a known key"));
  EXPECT_THAT(ErrorOf(R"([1, 2])"), HasSubstr("must be a JSON object"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [)"), HasSubstr("m.json: not valid JSON"));
  EXPECT_THAT(ErrorOf(""), HasSubstr("not valid JSON"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": 2, "memory_gb": 8}], "distances": [[10, 20]]})"),
              HasSubstr("distances[0] must have 1 entries (got 2)"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": 2, "memory_gb": 8}], "distances": [[0]]})"),
              HasSubstr("distances[0][0] must be >= 1 (got 0)"));
  EXPECT_THAT(ErrorOf(R"({"nodes": [{"id": 0, "cpus": 2, "memory_gb": 8}], "distances": [[10], [10]]})"),
              HasSubstr("distances must have one row per node"));
}

TEST(TopologyJson, LoadFileNamesThePath) {
  auto missing = LoadTopologyFile("/nonexistent/machine.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("/nonexistent/machine.json: cannot open"));

  const test::TempDir tmp("numoe-topology");
  const std::filesystem::path path = tmp.path() / "machine.json";
  {
    std::ofstream out(path);
    out << R"({"nodes": [{"id": 0, "cpus": 2, "memory_gb": -3}]})";
  }
  auto bad = LoadTopologyFile(path.string());
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr(path.string() + ": nodes[0].memory_gb must be > 0"));
}

TEST(CpuList, FormatsAndParses) {
  EXPECT_EQ(FormatCpuList({3, 0, 1, 2, 8, 10, 9}), "0-3,8-10");
  EXPECT_EQ(FormatCpuList({5}), "5");
  EXPECT_EQ(FormatCpuList({}), "");
  auto ids = ParseCpuList("0-2,7", "cpus");
  ASSERT_OK(ids);
  EXPECT_THAT(*ids, ElementsAre(0, 1, 2, 7));
  EXPECT_FALSE(ParseCpuList("", "cpus").ok());
  EXPECT_FALSE(ParseCpuList("1,,2", "cpus").ok());
  EXPECT_FALSE(ParseCpuList("0-2,1", "cpus").ok());
  EXPECT_FALSE(ParseCpuList("99999999", "cpus").ok());
}

TEST(TopologyProbe, ThisMachine) {
  auto t = ProbeTopology();
  ASSERT_OK(t);
  EXPECT_THAT(t->name, HasSubstr("this machine"));
  EXPECT_OK(ValidateTopology(*t, "probe"));
}

}  // namespace
}  // namespace numoe
