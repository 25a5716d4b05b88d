// Method knobs by name: parsing, applying, and errors that name what is wrong.
#include <gtest/gtest.h>

#include "runtime/knobs.h"

namespace kvs {
namespace {

TEST(Knobs, SpecsApplyToTheirMethodsConfig) {
  const MethodSpec s = parse_method_spec("tactic:target=0.75,dense_layers=0/2");
  EXPECT_EQ(s.method, Method::Tactic);
  EXPECT_EQ(s.label(), "target=0.75,dense_layers=0/2");
  const EngineConfig c = apply_knobs(EngineConfig{}, s);
  EXPECT_DOUBLE_EQ(c.tactic.target, 0.75);
  EXPECT_EQ(c.tactic.dense_layers, (std::vector<int>{0, 2}));
  EXPECT_DOUBLE_EQ(c.mac.tau, MacConfig{}.tau);  // other methods untouched

  const EngineConfig m = apply_knobs(EngineConfig{}, parse_method_spec("mac:threshold=paper,tau=0.5"));
  EXPECT_EQ(m.mac.threshold, MacThreshold::Paper);
  EXPECT_DOUBLE_EQ(m.mac.tau, 0.5);
  EXPECT_EQ(parse_method_spec("dense").label(), "default");
  const EngineConfig a =
      apply_knobs(EngineConfig{}, parse_method_spec("attnpred:calibration_keys=e4m3"));
  EXPECT_EQ(a.attnpred.calibration_keys, CalibrationKeys::E4m3);
  EXPECT_EQ(EngineConfig{}.attnpred.calibration_keys, CalibrationKeys::Bf16);
}

TEST(Knobs, ErrorsNameMethodKnobAndValue) {
  auto message = [](const std::string& spec) {
    try {
      apply_knobs(EngineConfig{}, parse_method_spec(spec));
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string unknown = message("tactic:budget=3");
  EXPECT_NE(unknown.find("no knob 'budget'"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("target"), std::string::npos) << unknown;  // lists the known ones
  const std::string bad = message("tactic:target=lots");
  EXPECT_NE(bad.find("'lots' is not a number"), std::string::npos) << bad;
  EXPECT_NE(message("mac:threshold=fuzzy").find("fuzzy"), std::string::npos);
  const std::string keys = message("attnpred:calibration_keys=fp8");
  EXPECT_NE(keys.find("'fp8' (known: bf16, e4m3, int4)"), std::string::npos) << keys;
  EXPECT_NE(message("tactic:target").find("not key=value"), std::string::npos);
  EXPECT_NE(message("dense:x=1").find("has no knob"), std::string::npos);
  EXPECT_THROW(parse_method_spec("quest"), std::invalid_argument);
}

}  // namespace
}  // namespace kvs
